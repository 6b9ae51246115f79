"""Model graders on the real served model through this worker's engine (worker/grading/engine_grader.py).

Structured outputs make the grader's answer well-formed: every label is one of ``labels`` and every
score a number within ``range``, whatever the small model thinks of the question.
"""

import pytest

from jobs.config import BUILTIN_MODEL
from jobs.evals.criteria import parse_testing_criteria
from worker.grading import grade_item
from worker.grading.engine_grader import EngineModelGrader

LABELS = ["positive", "negative", "neutral"]
REVIEWS = ["A wonderful, moving film.", "Dull and far too long.", "It was a film.", "asdf qwer"]


@pytest.mark.slow
def test_label_and_score_models_answer_within_labels_and_range(served_model_dir) -> None:
    from worker.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(served_model_dir), max_model_len=256, kv_cache_memory_bytes=1 << 24))
    grader = EngineModelGrader(engine, model=BUILTIN_MODEL)
    messages = [
        {"role": "system", "content": "Classify the sentiment of the review."},
        {"role": "user", "content": "Review: {{item.review}}"},
    ]
    label_model, score_model = parse_testing_criteria(
        [
            {
                "type": "label_model",
                "name": "sentiment",
                "model": BUILTIN_MODEL,
                "input": messages,
                "labels": LABELS,
                "passing_labels": ["positive"],
            },
            {
                "type": "score_model",
                "name": "positivity",
                "model": BUILTIN_MODEL,
                "input": messages,
                "range": [1, 5],
                "pass_threshold": 3,
                "sampling_params": {"temperature": 1.0, "seed": 7},
            },
        ]
    )
    samples = [{"output_text": ""}]
    for review in REVIEWS:
        labelled = grade_item(label_model, item={"review": review}, samples=samples, model_grader=grader)
        assert labelled.error is None and labelled.label in LABELS, labelled
        assert labelled.passed == (labelled.label == "positive")
    scored = grade_item(score_model, item={"review": REVIEWS[0]}, samples=samples, model_grader=grader)
    assert scored.error is None and scored.score is not None and 1 <= scored.score <= 5, scored
