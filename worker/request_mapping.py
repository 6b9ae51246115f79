"""Turn one batch line's body into what the engine takes: prompt token ids + `SamplingParams`.

Field semantics follow OpenAI's `/v1/completions` and `/v1/chat/completions`, with vLLM's
defaults and extensions where OpenAI is silent (vLLM `protocol.py`, `to_sampling_params`):
completions default to ``max_tokens=16``; chat defaults to ``max_tokens=None`` (up to the context
limit); ``max_completion_tokens`` wins over ``max_tokens`` for chat; chat ``logprobs: true`` with
``top_logprobs: k`` asks for k alternatives; completions ``echo`` with ``logprobs`` also asks for
prompt logprobs.

The API validates every body before a batch runs; the checks here still reject what the engine
cannot honour (``InvalidRequestError``, a 400 for that line only) so a body that slipped through can
never crash the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from worker.engine.sampling_params import SamplingParams

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_MAX_LOGPROBS = 20

# Body fields copied as-is onto SamplingParams (OpenAI's, then vLLM's extensions), with the type
# each value is coerced to.
_NUMERIC_FIELDS: dict[str, type] = {
    "n": int,
    "temperature": float,
    "top_p": float,
    "seed": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "min_tokens": int,
}
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# vLLM extensions this engine may or may not implement; passed through only when SamplingParams
# has the field, and rejected when asked for (truthy) but unsupported.
_OPTIONAL_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")
_SAMPLING_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer this module uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


class InvalidRequestError(ValueError):
    """A line body the endpoint rejects: becomes a 400 ``invalid_request_error`` for that line.

    Attributes:
        param: the body field at fault (OpenAI's ``error.param``), or None.
        code: OpenAI's ``error.code`` (e.g. ``"context_length_exceeded"``), or None.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(slots=True)
class MappedRequest:
    """One line ready for `LLMEngine.add_request`.

    ``prompt`` is the text the model sees (for chat, the rendered chat template; for a completions
    prompt given as token ids, their decoding is left to the response builder, so it is None).
    ``prompt_token_ids`` is what the engine is fed, so ``usage.prompt_tokens == len(prompt_token_ids)``.
    """

    endpoint: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    echo: bool = False


def map_request(endpoint: str, body: Mapping[str, Any], tokenizer: Tokenizer) -> MappedRequest:
    """Map a line body to prompt token ids and sampling parameters.

    Args:
        endpoint: ``"/v1/completions"`` or ``"/v1/chat/completions"``.
        body: the line's ``body`` object (already JSON-decoded).
        tokenizer: the served model's tokenizer (chat template included).

    Raises:
        InvalidRequestError: the body asks for something the endpoint cannot do (bad field type or
            range, empty prompt, unsupported option); ``param`` names the field.
    """
    if endpoint == COMPLETIONS:
        prompt, prompt_token_ids = _completion_prompt(body, tokenizer)
    elif endpoint == CHAT_COMPLETIONS:
        prompt, prompt_token_ids = _chat_prompt(body, tokenizer)
    else:
        raise InvalidRequestError(f"unsupported endpoint {endpoint!r}; use one of {list(ENDPOINTS)}", param="url")
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt" if endpoint == COMPLETIONS else "messages")
    echo = endpoint == COMPLETIONS and _as_bool(body, "echo")
    params = _sampling_params(endpoint, body, echo=echo)
    return MappedRequest(endpoint=endpoint, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params, echo=echo)


def _completion_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[str | None, list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt, as the OpenAI SDK may send it
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(
        "prompt must be a string or a list of token ids (one prompt per line)", param="prompt"
    )


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[str, list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    conversation = [_plain_message(message, idx) for idx, message in enumerate(messages)]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    # NOTE: the template already holds the special tokens; encoding must not add a second BOS.
    return text, tokenizer.encode(text, add_special_tokens=False)


def _plain_message(message: Any, idx: int) -> dict[str, str]:
    param = f"messages[{idx}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"{param} must be an object with a string 'role'", param=param)
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{param}.content: only text parts are supported", param=f"{param}.content")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
    return {"role": message["role"], "content": content}


def _sampling_params(endpoint: str, body: Mapping[str, Any], *, echo: bool) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    for name, kind in _NUMERIC_FIELDS.items():
        if body.get(name) is not None:
            kwargs[name] = _as_number(body, name, kind)
    for name in _BOOL_FIELDS:
        if body.get(name) is not None:
            kwargs[name] = _as_bool(body, name)
    for name in _OPTIONAL_FIELDS:
        value = body.get(name)
        if value is None or value is False:
            continue
        if name not in _SAMPLING_PARAM_NAMES:
            raise InvalidRequestError(f"{name} is not supported by this engine", param=name)
        kwargs[name] = value

    kwargs["max_tokens"] = _max_tokens(endpoint, body)
    kwargs["stop"] = _stop(body)
    if body.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = _int_list(body, "stop_token_ids")
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body)

    logprobs = _logprobs(endpoint, body)
    kwargs["logprobs"] = logprobs
    if echo and logprobs is not None:
        kwargs["prompt_logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=_named_field(str(exc))) from exc


def _max_tokens(endpoint: str, body: Mapping[str, Any]) -> int | None:
    if endpoint == CHAT_COMPLETIONS:
        for name in ("max_completion_tokens", "max_tokens"):
            if body.get(name) is not None:
                return _as_number(body, name, int)
        return None
    if body.get("max_tokens") is not None:
        return _as_number(body, "max_tokens", int)
    return _COMPLETIONS_DEFAULT_MAX_TOKENS


def _logprobs(endpoint: str, body: Mapping[str, Any]) -> int | None:
    if endpoint == CHAT_COMPLETIONS:
        top_logprobs = body.get("top_logprobs")
        if not _as_bool(body, "logprobs"):
            if top_logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        num = 0 if top_logprobs is None else _as_number(body, "top_logprobs", int)
        name = "top_logprobs"
    else:
        if body.get("logprobs") is None:
            return None
        num = _as_number(body, "logprobs", int)
        name = "logprobs"
    if not 0 <= num <= _MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be between 0 and {_MAX_LOGPROBS}, got {num}", param=name)
    return num


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise InvalidRequestError("stop must be a string or a list of strings", param="stop")


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    raw = body["logit_bias"]
    if not isinstance(raw, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id, amount = int(key), float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias entry {key!r}: {value!r} is not token id -> number", param="logit_bias") from None
        if not -100 <= amount <= 100:
            raise InvalidRequestError(f"logit_bias for token {token_id} must be in [-100, 100], got {amount}", param="logit_bias")
        bias[token_id] = amount
    return bias


def _int_list(body: Mapping[str, Any], name: str) -> list[int]:
    value = body[name]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidRequestError(f"{name} must be a list of integers", param=name)
    return list(value)


def _as_number(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    if kind is int and value != int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    return kind(value)


def _as_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _named_field(message: str) -> str | None:
    """The SamplingParams field a `ValueError` message starts with (its messages name the field)."""
    head = message.split(" ", 1)[0]
    return head if head in _SAMPLING_PARAM_NAMES else None
