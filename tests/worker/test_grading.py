"""Each grader type on fixed inputs (worker/grading/grade.py): asserted scores, and errors that stay the item's.

Text-similarity scores are compared with the library's own value computed here on the same inputs.
Model graders use a stand-in `ModelGrader` that records what it was asked; the real engine is in
tests/worker/test_engine_grader.py.
"""

from typing import Any

import pytest

from jobs.evals.criteria import parse_testing_criteria
from worker.grading import GradeResult, grade_item, grade_items
from worker.grading.sandbox import SandboxLimits

ITEM = {"question": "Capital of France?", "answer": "Paris"}
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_bytes=256 << 20, max_processes=16)


def _sample(text: str) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    return {"output_text": text, "choices": [choice], "model": "m", "usage": {"prompt_tokens": 3}}


def _criterion(**raw: Any) -> Any:
    (criterion,) = parse_testing_criteria([{"name": "c", **raw}])
    return criterion


def _string_check(operation: str) -> Any:
    return _criterion(
        type="string_check", operation=operation, input="{{sample.output_text}}", reference="{{item.answer}}"
    )


@pytest.mark.parametrize(
    ("operation", "output", "passed"),
    [
        ("eq", "Paris", True),
        ("eq", "paris", False),
        ("ne", "Lyon", True),
        ("ne", "Paris", False),
        ("like", "It is Paris.", True),
        ("like", "It is PARIS.", False),
        ("ilike", "It is PARIS.", True),
        ("ilike", "It is Lyon.", False),
    ],
)
def test_string_check(operation: str, output: str, passed: bool) -> None:
    result = grade_item(_string_check(operation), item=ITEM, samples=[_sample(output)])
    assert result == GradeResult(score=1.0 if passed else 0.0, passed=passed)


def test_text_similarity_grades_the_first_sample_only() -> None:
    criterion = _criterion(
        type="text_similarity",
        input="{{sample.output_text}}",
        reference="{{item.answer}}",
        evaluation_metric="fuzzy_match",
        pass_threshold=0.9,
    )
    result = grade_item(criterion, item=ITEM, samples=[_sample("Paris"), _sample("Lyon")])
    assert result.passed and result.score == 1.0


HYPOTHESIS = "the quick brown fox jumped over the lazy dog by the river bank today"
REFERENCE = "a quick brown fox jumps over the lazy dog by the river bank"


def _library_score(metric: str) -> float:
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.WRatio(HYPOTHESIS, REFERENCE) / 100
    if metric == "bleu":
        import sacrebleu

        return sacrebleu.sentence_bleu(HYPOTHESIS, [REFERENCE]).score / 100
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return sentence_gleu([REFERENCE.split()], HYPOTHESIS.split())
    from rouge_score import rouge_scorer

    rouge_type = "rougeL" if metric == "rouge_l" else "rouge" + metric[-1]
    return rouge_scorer.RougeScorer([rouge_type]).score(REFERENCE, HYPOTHESIS)[rouge_type].fmeasure


@pytest.mark.parametrize(
    "metric", ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]
)
def test_text_similarity_equals_the_library(metric: str) -> None:
    expected = _library_score(metric)
    assert 0.0 < expected < 1.0
    criterion = _criterion(
        type="text_similarity",
        evaluation_metric=metric,
        input="{{sample.output_text}}",
        reference="{{item.reference}}",
        pass_threshold=expected,
    )
    result = grade_item(criterion, item={"reference": REFERENCE}, samples=[_sample(HYPOTHESIS)])
    assert result == GradeResult(score=expected, passed=True)
    identical = grade_item(criterion, item={"reference": REFERENCE}, samples=[_sample(REFERENCE)])
    assert identical.score == pytest.approx(1.0) and identical.passed


@pytest.mark.slow  # loads the WordNet corpus (seconds)
def test_meteor_equals_nltk_with_wordnet() -> None:
    from nltk.corpus import wordnet
    from nltk.translate.meteor_score import meteor_score

    # "jumped"/"jumps" match by stem, "today" is unmatched: WordNet and the stemmer both count.
    expected = meteor_score([REFERENCE.split()], HYPOTHESIS.split(), wordnet=wordnet)
    assert 0.0 < expected < 1.0
    criterion = _criterion(
        type="text_similarity",
        evaluation_metric="meteor",
        input="{{sample.output_text}}",
        reference="{{item.reference}}",
        pass_threshold=expected,
    )
    result = grade_item(criterion, item={"reference": REFERENCE}, samples=[_sample(HYPOTHESIS)])
    assert result == GradeResult(score=expected, passed=True)
    synonym = grade_item(criterion, item={"reference": "the car is fast"}, samples=[_sample("the auto is fast")])
    exact_only = meteor_score([["the", "car", "is", "fast"]], ["the", "auto", "is", "fast"], wordnet=_NoSynonyms())
    assert synonym.score is not None and synonym.score > exact_only  # WordNet's car ~ auto counted


class _NoSynonyms:
    """A WordNet stand-in with no synsets, to show what the synonym stage adds."""

    def synsets(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        return []


@pytest.mark.slow  # builds the embedding engine and sentence-transformers' model (seconds)
def test_cosine_equals_sentence_transformers_and_embeds_the_items_at_once() -> None:
    from sentence_transformers import SentenceTransformer, util

    from jobs.config import BUILTIN_EMBEDDING_MODEL
    from worker.model_prepare import prepare_model

    pairs = [(HYPOTHESIS, REFERENCE), ("def add(a, b): return a + b", "a function that sums two numbers"), ("x", "y")]
    reference_model = SentenceTransformer(str(prepare_model(BUILTIN_EMBEDDING_MODEL)), device="cpu")
    expected = [
        float(util.cos_sim(reference_model.encode(text), reference_model.encode(reference)))
        for text, reference in pairs
    ]
    criterion = _criterion(
        type="text_similarity",
        evaluation_metric="cosine",
        input="{{sample.output_text}}",
        reference="{{item.reference}}",
        pass_threshold=0.5,
    )
    items = [({"reference": reference}, [_sample(text)]) for text, reference in pairs]
    results = grade_items(criterion, [*items, ({}, [_sample("no reference field")])])
    assert [result.score for result in results[:3]] == pytest.approx(expected, abs=1e-5)
    assert [result.passed for result in results[:3]] == [score >= 0.5 for score in expected]
    assert results[3].error is not None and "reference" in results[3].error  # its own error, neighbours graded


def test_an_absent_item_field_is_the_items_error() -> None:
    result = grade_item(_string_check("eq"), item={"question": "q"}, samples=[_sample("Paris")])
    assert result == GradeResult(score=None, passed=False, error="template names item.answer, which is absent")


PYTHON_SOURCE = """
def grade(sample, item):
    words = sample["output_text"].split()
    return sum(word.strip(".,") == item["answer"] for word in words) / len(words)
"""


def test_python_grader_scores_in_the_sandbox() -> None:
    criterion = _criterion(type="python", source=PYTHON_SOURCE, pass_threshold=0.25)
    result = grade_item(criterion, item=ITEM, samples=[_sample("It is Paris.")], limits=LIMITS)
    assert result == GradeResult(score=pytest.approx(1 / 3), passed=True)
    result = grade_item(criterion, item=ITEM, samples=[_sample("Lyon, not Paris, not Nice.")], limits=LIMITS)
    assert result == GradeResult(score=0.2, passed=False)


def test_python_grader_sees_output_json_and_its_errors_are_the_items() -> None:
    source = "def grade(sample, item):\n    return sample['output_json']['score']\n"
    criterion = _criterion(type="python", source=source)
    result = grade_item(criterion, item=ITEM, samples=[_sample('{"score": 1}')], limits=LIMITS)
    assert result == GradeResult(score=1.0, passed=True)
    result = grade_item(criterion, item=ITEM, samples=[_sample("not json")], limits=LIMITS)
    assert result.error == "python grader raised TypeError: 'NoneType' object is not subscriptable (line 2)"
    assert (result.score, result.passed) == (None, False)


def test_string_check_grades_every_one_of_n_samples() -> None:
    samples = [_sample("Paris"), _sample("Lyon"), _sample("Paris")]
    result = grade_item(_string_check("eq"), item=ITEM, samples=samples)
    assert result == GradeResult(score=2 / 3, passed=False, sample_results=["passed", "failed", "passed"])
    assert grade_item(_string_check("ilike"), item=ITEM, samples=[_sample("paris!")] * 2).passed
    assert grade_item(_string_check("eq"), item=ITEM, samples=[_sample("Paris")]) == GradeResult(1.0, True)


def test_python_grader_refused_network_access_says_so_in_a_sentence() -> None:
    source = "import socket\ndef grade(sample, item):\n    socket.socket()\n    return 1.0\n"
    result = grade_item(_criterion(type="python", source=source), item=ITEM, samples=[_sample("x")], limits=LIMITS)
    assert result.error == "python grader tried network access, which the sandbox refuses"


def test_python_grader_that_hangs_is_the_items_error_and_grading_goes_on() -> None:
    hanging = _criterion(type="python", source="def grade(sample, item):\n    while True:\n        pass\n")
    limits = SandboxLimits(timeout_s=1.0, cpu_s=5, memory_bytes=256 << 20, max_processes=16)
    result = grade_item(hanging, item=ITEM, samples=[_sample("x")], limits=limits)
    assert result == GradeResult(score=None, passed=False, error="python grader timed out after 1.0 s")
    assert grade_item(_string_check("eq"), item=ITEM, samples=[_sample("Paris")]).passed


class RecordingGrader:
    """A stand-in `ModelGrader` answering with fixed replies, recording each request."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    def generate(
        self, messages: list[dict[str, Any]], *, response_format: dict[str, Any] | None, sampling_params: dict[str, Any]
    ) -> str:
        self.requests.append({"messages": messages, "response_format": response_format, **sampling_params})
        return self.replies.pop(0)


JUDGE_INPUT = [
    {"role": "system", "content": "Score the answer."},
    {"role": "user", "content": [{"type": "input_text", "text": "Q: {{item.question}} A: {{sample.output_text}}"}]},
]


def test_score_model_asks_for_a_score_within_range() -> None:
    criterion = _criterion(
        type="score_model",
        model="m",
        input=JUDGE_INPUT,
        range=[1, 5],
        pass_threshold=4,
        sampling_params={"seed": 3, "max_completions_tokens": 16},
    )
    grader = RecordingGrader('{"score": 4.5}', '{"score": 2}', '{"score": 7}', '{"sco')
    assert grade_item(criterion, item=ITEM, samples=[_sample("Paris")], model_grader=grader) == GradeResult(4.5, True)
    assert grade_item(criterion, item=ITEM, samples=[_sample("Lyon")], model_grader=grader) == GradeResult(2.0, False)
    out_of_range = grade_item(criterion, item=ITEM, samples=[_sample("x")], model_grader=grader)
    assert out_of_range.error == "the grader model's score 7 is not a number in [1.0, 5.0]"
    cut_short = grade_item(criterion, item=ITEM, samples=[_sample("x")], model_grader=grader)
    assert cut_short.error is not None and cut_short.error.startswith("the grader model's reply is not JSON")
    request = grader.requests[0]
    assert request["messages"] == [
        {"role": "system", "content": "Score the answer."},
        {"role": "user", "content": "Q: Capital of France? A: Paris"},
    ]
    assert (request["temperature"], request["seed"], request["max_completion_tokens"]) == (0.0, 3, 16)
    schema = request["response_format"]["json_schema"]["schema"]
    assert request["response_format"]["json_schema"]["strict"] is True
    assert schema["properties"]["score"] == {"type": "number", "minimum": 1.0, "maximum": 5.0}


def test_label_model_asks_for_one_of_the_labels() -> None:
    criterion = _criterion(
        type="label_model",
        model="m",
        input=JUDGE_INPUT,
        labels=["correct", "incorrect"],
        passing_labels=["correct"],
    )
    grader = RecordingGrader('{"label": "correct"}', '{"label": "incorrect"}', '{"label": "maybe"}')
    result = grade_item(criterion, item=ITEM, samples=[_sample("Paris")], model_grader=grader)
    assert result == GradeResult(score=1.0, passed=True, label="correct")
    result = grade_item(criterion, item=ITEM, samples=[_sample("Lyon")], model_grader=grader)
    assert result == GradeResult(score=0.0, passed=False, label="incorrect")
    result = grade_item(criterion, item=ITEM, samples=[_sample("?")], model_grader=grader)
    assert result.error == "the grader model's label 'maybe' is not one of ['correct', 'incorrect']"
    label_schema = grader.requests[0]["response_format"]["json_schema"]["schema"]["properties"]["label"]
    assert label_schema == {"type": "string", "enum": ["correct", "incorrect"]}
    no_model = grade_item(criterion, item=ITEM, samples=[_sample("Paris")])
    assert no_model.error == "label_model needs a served model, and none was given"


def test_a_grader_model_that_raises_is_the_items_error() -> None:
    class Failing:
        def generate(self, messages: Any, *, response_format: Any, sampling_params: Any) -> str:
            raise RuntimeError("engine fault")

    criterion = _criterion(type="score_model", model="m", input=JUDGE_INPUT)
    result = grade_item(criterion, item=ITEM, samples=[_sample("x")], model_grader=Failing())
    assert result == GradeResult(
        score=None, passed=False, error="score_model grader failed: RuntimeError: engine fault"
    )


PROBLEM = {
    "prompt": "def add(a, b):\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


def test_code_execution_reports_pass_at_k_over_the_samples() -> None:
    criterion = _criterion(type="code_execution", pass_at_k=[1, 2, 5], timeout_s=2.0)
    completions = ["    return a + b\n", "    return a - b\n", "    return b + a\n", "    raise ValueError('no')\n"]
    result = grade_item(criterion, item=PROBLEM, samples=[_sample(text) for text in completions])
    assert result.error is None and not result.passed
    assert result.score == 0.5
    assert result.metrics == {"pass@1": 0.5, "pass@2": pytest.approx(1 - 1 / 6)}
    assert result.sample_results == [
        "passed",
        "failed: AssertionError (line 5)",
        "passed",
        "failed: ValueError: no (line 2)",
    ]
    all_pass = grade_item(criterion, item=PROBLEM, samples=[_sample("    return a + b\n")])
    assert all_pass == GradeResult(1.0, True, metrics={"pass@1": 1.0}, sample_results=["passed"])


def test_code_that_hangs_or_escapes_fails_its_sample_and_errors_the_item() -> None:
    criterion = _criterion(type="code_execution", pass_at_k=[1], timeout_s=1.0)
    completions = ["    return a + b\n", "    while True:\n        pass\n", "    import socket; socket.socket()\n"]
    result = grade_item(criterion, item=PROBLEM, samples=[_sample(text) for text in completions])
    assert result.score == pytest.approx(1 / 3) and result.metrics == {"pass@1": pytest.approx(1 / 3)}
    assert result.sample_results == ["passed", "timed out", "failed: tried network access, which the sandbox refuses"]
    assert result.error == (
        "the sandbox stopped sample 1: timed out; sample 2: failed: tried network access, which the sandbox refuses"
    )
    assert not result.passed


def test_grade_items_keeps_the_order_of_the_items() -> None:
    criterion = _criterion(type="code_execution", timeout_s=2.0)
    completions = ["    return a + b\n", "    return a * b\n", "    return 5\n"]
    results = grade_items(criterion, [(PROBLEM, [_sample(text)]) for text in completions])
    assert [result.passed for result in results] == [True, False, True]
    checks = grade_items(_string_check("eq"), [(ITEM, [_sample("Paris")]), (ITEM, [_sample("Lyon")])])
    assert [result.passed for result in checks] == [True, False]
