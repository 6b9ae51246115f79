"""The Evals API's ``{{item.x}}`` / ``{{sample.output_text}}`` templates (jobs/evals/templates.py)."""

import pytest

from jobs.evals.templates import TemplateError, referenced_fields, render


def test_renders_item_and_sample_fields_with_or_without_spaces() -> None:
    text = "Q: {{item.question}} A: {{ sample.output_text }} ({{item.meta.lang}}, {{item['a b']}})"
    item = {"question": "2+2?", "meta": {"lang": "en"}, "a b": 1}
    assert render(text, item=item, sample={"output_text": "4"}) == "Q: 2+2? A: 4 (en, 1)"


def test_structured_values_render_as_json() -> None:
    assert render("{{item.tags}}", item={"tags": ["a", "é"]}) == '["a", "é"]'


def test_referenced_fields_keep_the_longest_path() -> None:
    assert referenced_fields("{{item.meta.lang}} {{sample.output_text}}") == [
        ("item", "meta", "lang"),
        ("sample", "output_text"),
    ]


@pytest.mark.parametrize(
    ("text", "item", "sample", "message"),
    [
        ("{{item.answer}}", {"question": "q"}, None, "item.answer"),
        ("{{item.meta.lang}}", {"meta": "flat"}, None, "item.meta.lang"),
        ("{{sample.output_text}}", {}, None, "sample"),
        ("{{ config }}", {}, None, "'config'"),
        ("{{item.x", {}, None, "does not parse"),
    ],
)
def test_bad_templates_name_the_problem(text: str, item: dict, sample: dict | None, message: str) -> None:
    with pytest.raises(TemplateError, match=message.replace(".", r"\.").replace("(", r"\(")):
        render(text, item=item, sample=sample)


def test_the_sandbox_refuses_python_attributes() -> None:
    with pytest.raises(Exception):  # noqa: B017 - SecurityError or TemplateError, never a rendered secret
        render("{{ item.__class__.__mro__ }}", item={})
