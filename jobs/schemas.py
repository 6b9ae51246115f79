"""Pydantic models: input line bodies, and the file and batch objects the API returns.

Bodies follow OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` request fields, plus
vLLM's sampling extensions (vLLM ``entrypoints/openai/protocol.py``), and the text subset of
``/v1/responses``; structured output fields are parsed by `jobs.structured_outputs`. They are strict: numbers must
be JSON numbers (an integer field rejects ``1.5`` and ``true``), and an unknown field is rejected
with its name, so a typo never silently falls back to a default. They are the one place a body rule
lives: the worker parses each stored line with them (`jobs.line_body.parse_body`) and builds the
engine's ``SamplingParams`` from `sampling_kwargs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jobs.models import Batch, File
from jobs.status import BatchStatus
from jobs.structured_outputs import (
    GUIDED_FIELDS,
    Constraint,
    ResponseFormat,
    StructuredOutputs,
    TextFormat,
    guided_constraint,
)

MAX_N = 128  # samples per line, OpenAI's cap

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
SUPPORTED_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, EMBEDDINGS)
GENERATE_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES)
"""The endpoints a ``generate`` model serves; an ``embed`` model serves `EMBEDDINGS` only."""
MAX_EMBEDDING_INPUTS = 2048  # inputs per /v1/embeddings request, OpenAI's cap
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600
MAX_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_CUSTOM_ID_CHARS = 512

_STRICT = ConfigDict(strict=True, extra="forbid")

PositiveInt = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# A token id of the served model; its upper bound (the vocabulary) is checked where the model is
# loaded (the engine's add_request), for every field of this type.
TokenId = Annotated[int, Field(ge=0)]

# Sampling fields beam search has no use for (it ranks beams by the raw logprobs, as Hugging Face's
# num_beams with do_sample=False), with the value that asks for nothing; another value is refused.
_BEAM_SEARCH_NEUTRAL: dict[str, object] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}
# Body fields that are `SamplingParams` fields of the same name and meaning, copied when set.
_SAMPLING_FIELDS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "use_beam_search",
        "length_penalty",
        "early_stopping",
    }
)


def _one_message(message: str) -> WrapValidator:
    """A validator that reports any failure of the wrapped type as ``message``.

    For union-typed fields: pydantic would list why the value fails each member of the union
    ("String should have at least 1 character; Input should be a valid list"); users need one sentence.
    """

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", message) from None

    return WrapValidator(validate)


def _message_content(part: str, text_type: str) -> WrapValidator:
    """The validator of a message's ``content`` (a list of text parts): a string, taken as one part of
    type ``text_type``, or a non-empty list of text parts shaped like ``part``. Null and an empty list
    get their own message; a list's parts are checked one by one, so an error names the part and its
    field (``content[0].type``, ``content[0].foo``), as a ``str | list`` union could not."""
    shape = f"a string or a non-empty list of text parts ({part})"

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if value is None:
            raise PydanticCustomError("invalid_value", f"must not be null: a message's content is {shape}")
        if isinstance(value, str):
            return handler([{"type": text_type, "text": value}])
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_value", f"must be {shape}")
        if not value:
            raise PydanticCustomError("invalid_value", f"must not be empty: a message's content is {shape}")
        return handler(value)

    return WrapValidator(validate)


def _part_type(*served: str) -> WrapValidator:
    """The validator of a content part's ``type``: one of ``served``; the message says what it got."""
    names = repr(served[0]) if len(served) == 1 else "one of " + " or ".join(repr(name) for name in served)

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "invalid_value",
                f"{{got}} is not {names}: only text parts are served (images, files and audio are not)",
                {"got": repr(value)[:80]},
            ) from None

    return WrapValidator(validate)


def _refuse_streaming(stream: bool | None) -> bool | None:
    if stream:
        raise ValueError("streaming is not supported in a batch; remove it or set it to false")
    return stream


class _SamplingBody(BaseModel):
    """Fields both endpoints share: OpenAI sampling fields, then vLLM's extensions.

    `sampling_kwargs` turns a parsed body into the engine's ``SamplingParams`` keyword arguments
    (vLLM's ``to_sampling_params``), so the worker applies no rule of its own.
    """

    model_config = _STRICT

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Annotated[str | list[str], _one_message("must be a string or a list of strings")] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for the structured_outputs fields (jobs.structured_outputs.GUIDED_FIELDS)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator(*GUIDED_FIELDS)
    @classmethod
    def _guided_field(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            assert info.field_name is not None
            guided_constraint(info.field_name, value)
        return value

    def constraints(self) -> list[Constraint]:
        """Every structured output constraint the body gives (more than one is refused at parse)."""
        found = [] if self.structured_outputs is None else [self.structured_outputs.constraint("structured_outputs")]
        found += [
            guided_constraint(name, getattr(self, name)) for name in GUIDED_FIELDS if getattr(self, name) is not None
        ]
        return found

    @property
    def constraint(self) -> Constraint | None:
        """The line's structured output constraint (`jobs.structured_outputs.Constraint`), or None."""
        found = self.constraints()
        return found[0] if found else None

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingBody:
        found = self.constraints()
        if len(found) > 1:
            raise PydanticCustomError(
                "constraint_conflict",
                "cannot be combined with {first}: a line takes one structured output constraint",
                {"param": found[1].param.split(".")[0], "first": found[0].param.split(".")[0]},
            )
        return self

    @field_validator("stream")
    @classmethod
    def _no_streaming(cls, value: bool | None) -> bool | None:
        return _refuse_streaming(value)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (digit strings), got {key!r}")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        """The generation cap this body asks for (None = up to the context limit)."""
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives wanted per generated token (0 = the sampled token's only; None = no logprobs)."""
        return None

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> _SamplingBody:
        cap = self.effective_max_tokens
        if self.min_tokens is not None and cap is not None and self.min_tokens > cap:
            # NOTE: a model-level error has no location; ``param`` in its context names the field for
            # `jobs.line_body.parse_body`.
            raise PydanticCustomError(
                "min_tokens_above_max",
                "must be <= the max tokens ({cap}), got {min_tokens}",
                {"param": "min_tokens", "min_tokens": self.min_tokens, "cap": cap},
            )
        return self

    @model_validator(mode="after")
    def _beam_search_semantics(self) -> _SamplingBody:
        """Beam search (``n`` beams) is defined over the raw logprobs with stop token ids, not stop strings;
        it reports no per-token logprobs. Anything else it would silently ignore is refused, naming the field."""
        if not self.use_beam_search:
            return self
        refused = [name for name, neutral in _BEAM_SEARCH_NEUTRAL.items() if getattr(self, name) not in (None, neutral)]
        if self.stop:
            refused.append("stop")
        if self.logit_bias:
            refused.append("logit_bias")
        if self.num_logprobs is not None:
            refused.append("logprobs")
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of != self.n:
            refused.append("best_of")
        if refused:
            raise PydanticCustomError(
                "beam_search_conflict",
                "is not supported with use_beam_search (beam search ranks beams by the raw logprobs and takes "
                "stop_token_ids, not stop strings; it returns n beams and no logprobs): remove {fields}",
                {"param": refused[0], "fields": ", ".join(refused)},
            )
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's ``SamplingParams`` (plain values: jobs never imports the engine).

        Unset fields are left out so the engine's defaults apply, except ``max_tokens`` (None = up to
        the context limit); empty stop strings are dropped; ``logit_bias`` keys become ints.
        """
        kwargs = self.model_dump(include=set(_SAMPLING_FIELDS), exclude_none=True)
        if self.use_beam_search:
            kwargs["temperature"] = 0.0  # ignored by beam search; keeps the engine from sampling branches
        kwargs["max_tokens"] = self.effective_max_tokens
        if self.stop is not None:
            kwargs["stop"] = [stop for stop in ([self.stop] if isinstance(self.stop, str) else self.stop) if stop]
        if self.logit_bias is not None:
            kwargs["logit_bias"] = {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        if self.num_logprobs is not None:
            kwargs["logprobs"] = self.num_logprobs
        return kwargs


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a chat message's content."""

    model_config = _STRICT

    type: Annotated[Literal["text"], _part_type("text")]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string (kept as one text part) or a non-empty list of text parts,
    never null (OpenAI allows a null content only next to ``tool_calls``, which this service does not take).

    An assistant message may carry OpenAI's ``refusal`` (a string or null), as the messages this service
    writes in its output do; it is not part of the prompt. Another role with a ``refusal`` is refused.
    """

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[list[TextContentPart], _message_content('{"type": "text", "text": "..."}', "text")]
    name: str | None = None
    refusal: str | None = None

    @field_validator("refusal")
    @classmethod
    def _assistant_refusal_only(cls, refusal: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role is not None and role != "assistant":
            raise ValueError(f"only assistant messages have a refusal (this message's role is {role!r})")
        return refusal

    @property
    def text(self) -> str:
        """The content as one string (text parts joined; a string content is one part)."""
        return "".join(part.text for part in self.content)


class ChatCompletionBody(_SamplingBody):
    """A ``/v1/chat/completions`` body; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None

    def constraints(self) -> list[Constraint]:
        """``response_format`` (unless ``text``), then `_SamplingBody.constraints`."""
        own = None if self.response_format is None else self.response_format.constraint("response_format")
        return ([] if own is None else [own]) + super().constraints()

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    def conversation(self) -> list[dict[str, str]]:
        """The messages as ``[{"role", "content"}]`` for the tokenizer's chat template."""
        return [{"role": message.role, "content": message.text} for message in self.messages]


class CompletionBody(_SamplingBody):
    """A ``/v1/completions`` body: one prompt per line, as text or token ids (``max_tokens`` default 16).

    A list holding exactly one prompt (as some clients send it) is unwrapped; a list of several
    prompts is rejected (one prompt per batch line).
    """

    prompt: Annotated[
        Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)],
        _one_message("must be a non-empty string or a non-empty list of token ids (integers >= 0)"),
    ]
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionBody:
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError(
                "best_of_below_n",
                "must be >= n ({n}), got {best_of}",
                {"param": "best_of", "n": self.n, "best_of": self.best_of},
            )
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
            if len(prompt) != 1:
                raise ValueError(
                    f"holds {len(prompt)} prompts; a batch line takes one prompt "
                    "(a string or a list of token ids): put each prompt on its own line"
                )
            return prompt[0]
        return prompt

    def sampling_kwargs(self) -> dict[str, Any]:
        """As `_SamplingBody.sampling_kwargs`; ``echo`` with ``logprobs`` also asks for the prompt's logprobs."""
        kwargs = super().sampling_kwargs()
        if self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs
        if self.best_of is not None:
            kwargs["best_of"] = self.best_of
        return kwargs


class ResponsesContentPart(BaseModel):
    """A text part of a Responses input message: ``input_text``, or ``output_text`` (an earlier answer's
    part, as this service writes it: ``annotations`` is taken and left out of the prompt)."""

    model_config = _STRICT

    type: Annotated[Literal["input_text", "output_text"], _part_type("input_text", "output_text")]
    text: str
    annotations: list[Any] | None = None


class ResponsesMessage(BaseModel):
    """One item of a Responses ``input`` list: a message (``type`` "message" or absent) whose content is
    a string (kept as one ``input_text`` part) or a non-empty list of text parts. An output message fed
    back as history may keep its ``id`` and ``status``. Other item types (function calls, reasoning,
    item references) are not taken."""

    model_config = _STRICT

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[
        list[ResponsesContentPart],
        _message_content('{"type": "input_text" or "output_text", "text": "..."}', "input_text"),
    ]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined; a string content is one part)."""
        return "".join(part.text for part in self.content)


class ResponsesTextConfig(BaseModel):
    """The Responses API's ``text`` field: only ``format`` is taken."""

    model_config = _STRICT

    format: TextFormat | None = None


class ResponsesBody(BaseModel):
    """A ``/v1/responses`` body, the text subset of OpenAI's Responses API (docs/api.md, "Responses lines").

    ``input`` (a non-empty string, or a non-empty list of messages) follows ``instructions`` (a system
    message) in the chat template. ``seed`` is ours (OpenAI's Responses API has none), with the meaning it
    has on the other endpoints. ``store`` is taken and ignored: responses are not kept to be fetched
    again; the batch's output file holds them. Every other field (tools, reasoning, previous_response_id,
    background, include, ...) is an unknown field, a 400 naming it.
    """

    model_config = _STRICT

    model: str
    input: list[ResponsesMessage]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    text: ResponsesTextConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = None
    store: bool | None = None
    user: str | None = None
    stream: bool | None = None

    @field_validator("stream")
    @classmethod
    def _no_streaming(cls, value: bool | None) -> bool | None:
        return _refuse_streaming(value)

    @field_validator("input", mode="before")
    @classmethod
    def _input_as_messages(cls, value: Any) -> Any:
        """A string is one user message; the messages' own checks then name ``input[i].field``."""
        if isinstance(value, str) and value:
            return [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string or a non-empty list of messages")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs are allowed, got {len(value)}")
            for key in value:
                if len(key) > MAX_METADATA_KEY_CHARS:
                    raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters, got {key[:80]!r}")
        return value

    @property
    def constraint(self) -> Constraint | None:
        """``text.format``'s constraint (`jobs.structured_outputs.Constraint`), or None."""
        if self.text is None or self.text.format is None:
            return None
        return self.text.format.constraint("text.format")

    def conversation(self) -> list[dict[str, str]]:
        """``instructions`` and ``input`` as ``[{"role", "content"}]`` for the tokenizer's chat template."""
        instructions = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        return instructions + [{"role": message.role, "content": message.text} for message in self.input]

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's ``SamplingParams``: one sample, ``max_output_tokens`` as
        ``max_tokens`` (None = up to the context limit), and the sampling fields set."""
        kwargs = self.model_dump(include={"temperature", "top_p", "seed"}, exclude_none=True)
        return {"n": 1, "max_tokens": self.max_output_tokens, **kwargs}

    def echoed_fields(self) -> dict[str, Any]:
        """The request fields a Responses object repeats, with OpenAI's defaults for those not given."""
        text_format = self.text.format if self.text is not None and self.text.format is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {
                "format": {"type": "text"}
                if text_format is None
                else text_format.model_dump(by_alias=True, exclude_none=True)
            },
            "user": self.user,
        }


# OpenAI's Responses API fields this service does not serve (tools, state kept between responses,
# reasoning...): refused like any unknown field, with words that say why (`jobs.line_body`).
RESPONSES_NOT_SERVED = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_tool_calls",
        "reasoning",
        "include",
        "previous_response_id",
        "conversation",
        "background",
        "prompt",
        "truncation",
        "top_logprobs",
        "service_tier",
        "stream_options",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "context_management",
    }
)

_EMBEDDING_INPUT_SHAPE = (
    "a non-empty string, a non-empty list of non-empty strings, a non-empty list of token ids "
    f"(integers >= 0) or a non-empty list of such lists (at most {MAX_EMBEDDING_INPUTS} inputs)"
)


def _embedding_input(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """``input``'s validator: empty strings and lists get their own words (OpenAI refuses both), naming the
    item at fault (``input[3]``); any other misfit gets one sentence stating the four accepted shapes."""
    if value == "":
        raise PydanticCustomError("invalid_value", "must not be an empty string")
    if value == []:
        raise PydanticCustomError("invalid_value", "must not be an empty list")
    if isinstance(value, list):
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise PydanticCustomError(
                "invalid_value",
                "holds {count} inputs; a request embeds at most {limit}: split it over several lines",
                {"count": len(value), "limit": MAX_EMBEDDING_INPUTS},
            )
        empty = next((i for i, item in enumerate(value) if item in ("", [])), None)
        if empty is not None:
            raise PydanticCustomError("invalid_value", "item {index} is empty", {"index": empty})
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("invalid_value", f"must be {_EMBEDDING_INPUT_SHAPE}") from None


class EmbeddingBody(BaseModel):
    """A ``/v1/embeddings`` body (OpenAI's ``EmbeddingCreateParams``, plus vLLM's ``truncate_prompt_tokens``).

    ``input`` is one text, several texts, one list of token ids or several lists (one embedding each, in
    order). ``dimensions`` asks for shortened embeddings (Matryoshka models only: the worker answers a 400 for
    other models). ``truncate_prompt_tokens`` (``>= 1``, or ``-1`` for the model's limit) cuts each input to
    that many tokens instead of refusing a longer one.
    """

    model_config = _STRICT

    model: str
    input: Annotated[
        str | list[str] | list[TokenId] | list[list[TokenId]],
        WrapValidator(_embedding_input),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be >= 1, or -1 for the model's limit")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs one by one: texts, or lists of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(item, int) for item in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


LineBody = ChatCompletionBody | CompletionBody | ResponsesBody | EmbeddingBody
BODY_SCHEMAS: dict[str, type[LineBody]] = {
    CHAT_COMPLETIONS: ChatCompletionBody,
    COMPLETIONS: CompletionBody,
    RESPONSES: ResponsesBody,
    EMBEDDINGS: EmbeddingBody,
}


class LineError(BaseModel):
    """One problem found in an input file; ``line`` is 1-based, None for whole-file problems."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class ListedObject(BaseModel):
    """An object a cursor page (:class:`ListPage`) lists: it has an ``id``, the page's cursor."""

    id: str


class FileObject(ListedObject):
    """OpenAI's File object (``status`` and ``status_details`` are the deprecated fields strict clients read)."""

    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @classmethod
    def from_row(cls, file: File) -> FileObject:
        return cls(
            id=file.id,
            bytes=file.num_bytes,
            created_at=file.created_at,
            filename=file.filename,
            purpose=file.purpose,
            expires_at=file.expires_at,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchErrors(BaseModel):
    """OpenAI's ``errors`` list; ``data`` holds the first `jobs.validation.MAX_ERRORS`, ``total`` counts
    every error found (batchinfer's addition)."""

    object: Literal["list"] = "list"
    data: list[LineError]
    total: int


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class BatchObject(ListedObject):
    """OpenAI's Batch object, every field present (null when unset)."""

    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    model: str | None
    usage: BatchUsage

    @classmethod
    def from_row(cls, batch: Batch) -> BatchObject:
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            errors=None
            if batch.errors is None
            else BatchErrors(
                data=[LineError(**e) for e in batch.errors],
                total=len(batch.errors) if batch.num_errors is None else batch.num_errors,
            ),
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=BatchStatus(batch.status),
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=batch.created_at,
            in_progress_at=batch.in_progress_at,
            expires_at=batch.expires_at,
            finalizing_at=batch.finalizing_at,
            completed_at=batch.completed_at,
            failed_at=batch.failed_at,
            expired_at=batch.expired_at,
            cancelling_at=batch.cancelling_at,
            cancelled_at=batch.cancelled_at,
            request_counts=RequestCounts(
                total=batch.total_requests, completed=batch.completed_requests, failed=batch.failed_requests
            ),
            metadata=batch.metadata_,
            model=batch.model,
            usage=BatchUsage(
                input_tokens=batch.input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=batch.cached_tokens),
                output_tokens=batch.output_tokens,
                total_tokens=batch.input_tokens + batch.output_tokens,
            ),
        )


T = TypeVar("T", bound=ListedObject)


class ListPage(BaseModel, Generic[T]):
    """OpenAI's cursor page: ``{object: "list", data, first_id, last_id, has_more}``."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[T], has_more: bool) -> ListPage[T]:
        """The page holding ``data`` (objects with an ``id``); first/last ids are derived from it."""
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )
