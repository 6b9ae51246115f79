"""An eval's testing criteria (jobs/evals/criteria.py): the Evals API's graders parsed once, bad ones named."""

from typing import Any

import pytest

from jobs.evals.criteria import (
    CodeExecutionCriterion,
    CriteriaError,
    LabelModelCriterion,
    PythonCriterion,
    ScoreModelCriterion,
    StringCheckCriterion,
    TextSimilarityCriterion,
    needs_model,
    parse_testing_criteria,
)

STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
TEXT_SIMILARITY = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "rouge_l",
    "pass_threshold": 0.5,
}
PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n", "pass_threshold": 0.5}
MESSAGES = [
    {"role": "system", "content": "Grade the answer."},
    {"role": "user", "content": [{"type": "input_text", "text": "Q: {{item.question}} A: {{sample.output_text}}"}]},
]
SCORE_MODEL = {
    "type": "score_model",
    "name": "judge",
    "model": "m",
    "input": MESSAGES,
    "range": [1, 5],
    "sampling_params": {"temperature": 0.5, "max_completions_tokens": 20, "seed": 1, "top_p": 0.9},
}
LABEL_MODEL = {
    "type": "label_model",
    "name": "sentiment",
    "model": "m",
    "input": MESSAGES,
    "labels": ["positive", "negative"],
    "passing_labels": ["positive"],
}
CODE = {"type": "code_execution", "name": "humaneval", "pass_at_k": [1, 10]}


def test_every_grader_type_parses_into_its_model() -> None:
    criteria = parse_testing_criteria([STRING_CHECK, TEXT_SIMILARITY, PYTHON, SCORE_MODEL, LABEL_MODEL, CODE])
    types = [StringCheckCriterion, TextSimilarityCriterion, PythonCriterion, ScoreModelCriterion]
    types += [LabelModelCriterion, CodeExecutionCriterion]
    assert [type(criterion) for criterion in criteria] == types
    assert [needs_model(criterion) for criterion in criteria] == [False, False, False, True, True, False]
    score_model = criteria[3]
    assert isinstance(score_model, ScoreModelCriterion)
    assert score_model.score_range == (1.0, 5.0) and score_model.threshold == 5.0
    code = criteria[5]
    assert isinstance(code, CodeExecutionCriterion)
    assert (code.prompt, code.test, code.entry_point) == ("{{item.prompt}}", "{{item.test}}", "{{item.entry_point}}")
    assert code.timeout_s == 3.0 and code.pass_threshold == 1.0


def test_templates_lists_each_rendered_field() -> None:
    (label_model,) = parse_testing_criteria([LABEL_MODEL])
    assert list(label_model.templates()) == [
        ("input[0].content", "Grade the answer."),
        ("input[1].content[0]", "Q: {{item.question}} A: {{sample.output_text}}"),
    ]


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**base, **changes}
    return {key: value for key, value in out.items() if value is not None}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"testing_criteria": "nope"}, "testing_criteria: must be a list"),
        ([{"name": "x"}], "testing_criteria[0].type: missing"),
        ([STRING_CHECK, {"type": "regex", "name": "x"}], "testing_criteria[1].type: unknown grader type 'regex'"),
        ([_with(STRING_CHECK, reference=None)], "testing_criteria[0].reference: Field required"),
        ([_with(STRING_CHECK, operation="regex")], "testing_criteria[0].operation:"),
        ([_with(STRING_CHECK, input="{{output_text}}")], "testing_criteria[0].input: template names 'output_text'"),
        ([_with(STRING_CHECK, input="{{item.a")], "testing_criteria[0].input: template does not parse"),
        ([_with(STRING_CHECK, extra=1)], "testing_criteria[0].extra: Extra inputs are not permitted"),
        ([_with(TEXT_SIMILARITY, evaluation_metric="chrf")], "testing_criteria[0].evaluation_metric:"),
        ([_with(TEXT_SIMILARITY, pass_threshold=None)], "testing_criteria[0].pass_threshold: Field required"),
        (
            [_with(PYTHON, source="def grade(sample, item)\n    return 1")],
            "testing_criteria[0].source: does not compile",
        ),
        ([_with(PYTHON, source="score = 1.0\n")], "testing_criteria[0].source: defines no top-level grade"),
        ([_with(PYTHON, image_tag="2025-05-08")], "testing_criteria[0].image_tag:"),
        ([_with(SCORE_MODEL, range=[5, 1])], "testing_criteria[0].range: must be [low, high]"),
        ([_with(SCORE_MODEL, input=[])], "testing_criteria[0].input: List should have at least 1 item"),
        (
            [_with(SCORE_MODEL, sampling_params={"reasoning_effort": "low"})],
            "testing_criteria[0].sampling_params.reasoning_effort: Extra inputs",
        ),
        (
            [_with(LABEL_MODEL, passing_labels=["neutral"])],
            "testing_criteria[0].passing_labels: ['neutral'] are not in",
        ),
        ([_with(LABEL_MODEL, labels=["a", "a"])], "testing_criteria[0].labels: must not repeat a label"),
        (
            [_with(LABEL_MODEL, input=[{"role": "user", "content": "{{item.q}} {{bogus.x}}"}])],
            "testing_criteria[0].input[0].content: template names 'bogus'",
        ),
        (
            [_with(LABEL_MODEL, input=[{"role": "user", "content": {"type": "input_image", "image_url": "x"}}])],
            "testing_criteria[0].input[0].content: content part type 'input_image' is not served",
        ),
        ([_with(CODE, pass_at_k=[0])], "testing_criteria[0].pass_at_k[0]: Input should be greater than 0"),
        ([_with(CODE, test="{{item.test")], "testing_criteria[0].test: template does not parse"),
    ],
)
def test_bad_criteria_are_refused_naming_the_field(raw: Any, message: str) -> None:
    with pytest.raises(CriteriaError) as caught:
        parse_testing_criteria(raw)
    assert message in str(caught.value)
