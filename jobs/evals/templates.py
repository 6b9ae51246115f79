"""The Evals API's templates: ``{{item.field}}`` and ``{{sample.output_text}}`` in input messages and graders.

Rendered by Jinja2's sandboxed environment (a template cannot reach Python attributes or call
anything), with undefined names as errors, so a template naming a field an item lacks fails with a
message that names the field instead of rendering an empty string. Only the namespaces ``item`` and
``sample`` exist; nested fields are reached with dots (``{{item.meta.lang}}``) or brackets
(``{{item["a b"]}}``). A value that is not a string is rendered as JSON, as the Evals API does for
structured items.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError, UndefinedError, nodes
from jinja2.sandbox import SandboxedEnvironment

NAMESPACES = ("item", "sample")


class TemplateError(ValueError):
    """A template that does not parse, names an unknown namespace, or names a field its data lacks."""


def _finalize(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return value


_ENVIRONMENT = SandboxedEnvironment(undefined=StrictUndefined, finalize=_finalize, autoescape=False)


def _parse(text: str) -> nodes.Template:
    try:
        return _ENVIRONMENT.parse(text)
    except TemplateSyntaxError as exc:
        raise TemplateError(f"template does not parse: {exc.message} (line {exc.lineno})") from None


def _path(node: nodes.Node) -> list[str] | None:
    """``item.a.b`` or ``item["a"]`` as ``["item", "a", "b"]``; None for anything else."""
    if isinstance(node, nodes.Name):
        return [node.name]
    if isinstance(node, nodes.Getattr):
        base = _path(node.node)
        return None if base is None else [*base, node.attr]
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
        base = _path(node.node)
        return None if base is None else [*base, node.arg.value]
    return None


def referenced_fields(text: str) -> list[tuple[str, ...]]:
    """The field paths a template reads, outermost first, e.g. ``[("item", "question")]``.

    Raises:
        TemplateError: the template does not parse or names a variable other than ``item``/``sample``.
    """
    template = _parse(text)
    paths: list[tuple[str, ...]] = []
    for node in template.find_all((nodes.Getattr, nodes.Getitem, nodes.Name)):
        path = _path(node)
        if path is None:
            continue
        if path[0] not in NAMESPACES:
            raise TemplateError(f"template names {path[0]!r}; only {' and '.join(NAMESPACES)} exist")
        # find_all visits an expression before its parts: keep only the longest path of each chain.
        if not any(existing[: len(path)] == tuple(path) for existing in paths):
            paths.append(tuple(path))
    return paths


def render(text: str, *, item: dict[str, Any], sample: dict[str, Any] | None = None) -> str:
    """Render ``text`` with ``item`` (one data item) and ``sample`` (the model's output, when graded).

    Raises:
        TemplateError: the template does not parse, or names a field absent from ``item``/``sample``
            (the message names the field, e.g. ``item.answer``).
    """
    for path in referenced_fields(text):
        value: Any = {"item": item, "sample": sample}
        for depth, key in enumerate(path):
            if not isinstance(value, dict) or key not in value:
                raise TemplateError(f"template names {'.'.join(path[: depth + 1])}, which is absent")
            value = value[key]
    try:
        return _ENVIRONMENT.from_string(text).render(item=item, sample=sample or {})
    except UndefinedError as exc:
        raise TemplateError(f"template names a field that is absent: {exc.message}") from None
