"""Structured outputs on a line body: OpenAI's ``response_format`` and ``text.format``, vLLM's ``structured_outputs``.

Everything here needs no model: the body parse (`jobs.line_body.parse_body`) checks a JSON Schema
against its metaschema (the ``jsonschema`` library, the draft its ``$schema`` names, else 2020-12), an
empty ``choice``, two constraints on one line, and OpenAI's rules for ``strict: true`` schemas
(`strict_schema_problem`). What only the grammar engine can judge (a regex in its dialect, a grammar's
syntax, a schema keyword it cannot compile) is refused when the line joins the engine, with the same
per-line 400; `Constraint.param` names the body field it came from.

A parsed body gives its constraint as a `Constraint`: plain keyword arguments for the engine's
``StructuredOutputsParams`` (exactly one of ``json`` (a schema dict), ``regex``, ``choice`` (a tuple),
``grammar``, ``json_object=True``; vLLM ``sampling_params.StructuredOutputsParams``), so this package
never imports the worker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from jsonschema import SchemaError, validators
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's limits on a strict schema ("Structured Outputs", "Supported schemas").
MAX_STRICT_NESTING = 10
MAX_STRICT_PROPERTIES = 5000
MAX_STRICT_ENUM_VALUES = 1000
MAX_STRICT_STRING_CHARS = 120_000
MAX_STRICT_LARGE_ENUM_CHARS = 15_000
LARGE_ENUM_VALUES = 250
# OpenAI's rule for a format's name: a-z, A-Z, 0-9, underscores and dashes, at most 64 characters.
FORMAT_NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}"
# vLLM's constraint fields (`structured_outputs.<field>`), in the order they are looked at.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's older per-field names (removed in vLLM 0.12), each the `structured_outputs` field it stands for.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}

_STRICT = ConfigDict(strict=True, extra="forbid")
_COMPOSITIONS = ("anyOf", "oneOf", "allOf")


@dataclass(frozen=True, slots=True)
class Constraint:
    """One line's structured output constraint.

    ``kwargs``: the engine's ``StructuredOutputsParams`` keyword arguments, exactly one key (``json``: a
    schema dict; ``regex``, ``grammar``: str; ``choice``: a tuple of str; ``json_object``: True).
    ``param``: the body field it came from (``response_format.json_schema.schema``,
    ``structured_outputs.regex``, ``text.format.schema``...), named by the line's 400 when the engine
    cannot compile it.
    """

    kwargs: dict[str, Any]
    param: str


def checked_schema(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON Schema object valid against its metaschema (JSON text is parsed first).

    The metaschema is the draft ``$schema`` names, else 2020-12; formats are not checked (a ``pattern``
    is left to the grammar engine's regex dialect).

    Raises:
        ValueError: not an object (or JSON text of one), or not valid JSON Schema; the message says where.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON text: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON Schema object (or its JSON text)")
    try:
        # NOTE: no format checks: they would compile each `pattern` with Python's `re`, whose dialect is
        # not the grammar engine's (which judges patterns when the line joins it).
        validators.validator_for(value).check_schema(value, format_checker=None)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise ValueError(f"is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    return value


def _format_name(name: str) -> str:
    if not re.fullmatch(FORMAT_NAME_PATTERN, name):
        raise ValueError(f"must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {name[:80]!r}")
    return name


def _schema_for_format(value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    schema = checked_schema(value)
    if info.data.get("strict"):
        problem = strict_schema_problem(schema)
        if problem is not None:
            raise ValueError(f"breaks OpenAI's rules for strict schemas: {problem}")
    return schema


# NOTE: `strict` must be declared before the schema field in a model, so the schema's check sees it.
FormatSchema = Annotated[dict[str, Any], AfterValidator(_schema_for_format)]
FormatName = Annotated[str, AfterValidator(_format_name)]


def strict_schema_problem(schema: dict[str, Any]) -> str | None:
    """The first way ``schema`` breaks OpenAI's rules for ``strict: true``, in words; None when it keeps them.

    The rules (OpenAI's "Structured Outputs" guide, "Supported schemas"): the root is an object, not an
    ``anyOf``; every object sets ``additionalProperties: false`` and lists all its properties in
    ``required``; at most 10 levels of nesting (counted through ``properties`` and ``items``; a ``$defs``
    entry counts from its own root), 5,000 properties, 1,000 enum values, 120,000 characters of property
    names, definition names, enum and const strings, and 15,000 characters in one string enum of more than
    250 values. Keywords themselves are left to the grammar engine.
    """
    if "anyOf" in schema:
        return 'the root must be an object ("type": "object"), not an anyOf'
    if "type" not in schema:
        return 'the root must be an object ("type": "object"); it has no "type"'
    if schema["type"] != "object":
        return f'the root must be an object ("type": "object"), not "type": {json.dumps(schema["type"])}'
    num_properties = num_enum_values = num_chars = 0
    stack: list[tuple[Any, str, int]] = [(schema, "#", 1)]
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_STRICT_NESTING:
            return f"{where} is nested more than {MAX_STRICT_NESTING} levels deep"
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        if _is_object(node):
            if node.get("additionalProperties") is not False:
                return f'the object at {where} must set "additionalProperties": false'
            required = node.get("required")
            missing = [name for name in properties if not isinstance(required, list) or name not in required]
            if missing:
                return f'the object at {where} must list every property in "required" (missing: {", ".join(missing)})'
        num_properties += len(properties)
        num_chars += sum(len(name) for name in properties)
        enum = node.get("enum")
        if isinstance(enum, list):
            num_enum_values += len(enum)
            enum_chars = sum(len(value) for value in enum if isinstance(value, str))
            num_chars += enum_chars
            if len(enum) > LARGE_ENUM_VALUES and enum_chars > MAX_STRICT_LARGE_ENUM_CHARS:
                return (
                    f"the enum at {where} has {len(enum)} values of {enum_chars} characters in all "
                    f"(at most {MAX_STRICT_LARGE_ENUM_CHARS} above {LARGE_ENUM_VALUES} values)"
                )
        if isinstance(node.get("const"), str):
            num_chars += len(node["const"])
        for name, child in properties.items():
            stack.append((child, f"{where}/properties/{name}", depth + 1))
        items = node.get("items")
        for index, child in enumerate(items if isinstance(items, list) else [items]):
            stack.append((child, f"{where}/items" + (f"/{index}" if isinstance(items, list) else ""), depth + 1))
        prefix_items = node.get("prefixItems")
        for index, child in enumerate(prefix_items if isinstance(prefix_items, list) else []):
            stack.append((child, f"{where}/prefixItems/{index}", depth + 1))
        for keyword in _COMPOSITIONS:
            branches = node.get(keyword)
            for index, child in enumerate(branches if isinstance(branches, list) else []):
                stack.append((child, f"{where}/{keyword}/{index}", depth))
        for keyword in ("$defs", "definitions"):
            definitions = node.get(keyword)
            for name, child in (definitions if isinstance(definitions, dict) else {}).items():
                num_chars += len(name)
                stack.append((child, f"{where}/{keyword}/{name}", 1))
    if num_properties > MAX_STRICT_PROPERTIES:
        return f"it has {num_properties} object properties (at most {MAX_STRICT_PROPERTIES})"
    if num_enum_values > MAX_STRICT_ENUM_VALUES:
        return f"it has {num_enum_values} enum values (at most {MAX_STRICT_ENUM_VALUES})"
    if num_chars > MAX_STRICT_STRING_CHARS:
        return f"its names, enum and const strings total {num_chars} characters (at most {MAX_STRICT_STRING_CHARS})"
    return None


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (chat): ``{name, description?, strict?, schema}``."""

    model_config = _STRICT

    name: FormatName
    description: str | None = None
    strict: bool | None = None
    schema_: FormatSchema = Field(alias="schema")


class ResponseFormat(BaseModel):
    """Chat's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _json_schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "json_schema_type", 'is required with "type": "json_schema"', {"param": "json_schema"}
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise PydanticCustomError(
                "json_schema_type", 'is only taken with "type": "json_schema"', {"param": "json_schema"}
            )
        return self

    def constraint(self, param: str) -> Constraint | None:
        """The constraint this format asks for (None for ``text``); ``param`` is where it sits in the body."""
        if self.json_schema is not None:
            return Constraint({"json": self.json_schema.schema_}, f"{param}.json_schema.schema")
        if self.type == "json_object":
            return Constraint({"json_object": True}, param)
        return None


class TextFormat(BaseModel):
    """The Responses API's ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", name, description?, strict?, schema}`` (the fields sit beside ``type``)."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    name: FormatName | None = None
    description: str | None = None
    strict: bool | None = None
    schema_: FormatSchema | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _fields_of_json_schema(self) -> TextFormat:
        given = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        if self.type == "json_schema":
            for field in ("name", "schema"):
                if given[field] is None:
                    raise PydanticCustomError(
                        "json_schema_field", 'is required with "type": "json_schema"', {"param": field}
                    )
        else:
            for field, value in given.items():
                if value is not None:
                    raise PydanticCustomError(
                        "json_schema_field", 'is only taken with "type": "json_schema"', {"param": field}
                    )
        return self

    def constraint(self, param: str) -> Constraint | None:
        """As `ResponseFormat.constraint`; a schema's ``param`` is ``{param}.schema``."""
        if self.schema_ is not None:
            return Constraint({"json": self.schema_}, f"{param}.schema")
        if self.type == "json_object":
            return Constraint({"json_object": True}, param)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` body field: exactly one of ``json`` (a JSON Schema, as an object or
    its JSON text), ``regex`` (the whole output matches it), ``choice`` (the output is one of these
    strings), ``grammar`` (EBNF/GBNF, root rule ``root``) or ``json_object: true`` (any JSON object).

    vLLM's other options (``disable_any_whitespace``, ``whitespace_pattern``, ``structural_tag``...) are
    not taken: each is an unknown field.
    """

    model_config = _STRICT

    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None

    @field_validator("json_")
    @classmethod
    def _valid_schema(cls, value: Any) -> Any:
        return None if value is None else checked_schema(value)

    @field_validator("choice")
    @classmethod
    def _some_choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must hold at least one string")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = self.given()
        if len(given) != 1:
            raise PydanticCustomError(
                "structured_outputs_count",
                "must set exactly one of json, regex, choice, grammar or json_object (true), got {given}",
                {"given": ", ".join(given) or "none"},
            )
        return self

    def given(self) -> list[str]:
        """The constraint fields set (``json_object`` counts when true)."""
        is_set = {
            "json": self.json_ is not None,
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
            "json_object": bool(self.json_object),
        }
        return [name for name in CONSTRAINT_FIELDS if is_set[name]]

    def constraint(self, param: str) -> Constraint:
        """The one constraint set, named ``{param}.{field}``."""
        (name,) = self.given()
        value: Any = {"json": self.json_, "regex": self.regex, "grammar": self.grammar}.get(name)
        if name == "choice":
            value = tuple(self.choice or ())
        elif name == "json_object":
            value = True
        return Constraint({name: value}, f"{param}.{name}")


def guided_constraint(field: str, value: Any) -> Constraint:
    """The constraint of one of vLLM's older ``guided_*`` fields (`GUIDED_FIELDS`), checked as its
    ``structured_outputs`` twin; ``param`` is the ``guided_*`` field.

    Raises:
        ValueError: as the twin field's check.
    """
    name = GUIDED_FIELDS[field]
    if name == "json":
        value = checked_schema(value)
    elif name == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
            raise ValueError("must be a non-empty list of strings")
        value = tuple(value)
    elif not isinstance(value, str) or (name == "grammar" and not value):
        raise ValueError("must be a non-empty string" if name == "grammar" else "must be a string")
    return Constraint({name: value}, field)
