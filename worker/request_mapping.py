"""Turn one stored batch line into what the engine takes: prompt token ids + `SamplingParams`.

The body is parsed by its endpoint's schema (`jobs.line_body.parse_body`), which holds every body
rule (limits, defaults, cross-field checks) and gives the `SamplingParams` keyword arguments (vLLM's
``to_sampling_params``) and the structured output constraint as plain data
(`jobs.structured_outputs.Constraint`), made a `StructuredOutputsParams` here. This module adds only
what needs the model: the chat template (chat and Responses lines) and the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from jobs.line_body import parse_body
from jobs.schemas import ChatCompletionBody, EmbeddingBody, ResponsesBody
from worker.engine import SamplingParams
from worker.engine.sampling_params import StructuredOutputsParams


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer this module uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(slots=True)
class MappedRequest:
    """One line ready for `LLMEngine.add_request`.

    ``prompt`` is the text the model sees (for chat, the rendered chat template; for a completions
    prompt given as token ids, their decoding is left to the response builder, so it is None).
    ``prompt_token_ids`` is what the engine is fed, so ``usage.prompt_tokens == len(prompt_token_ids)``.
    ``structured_outputs_param`` names the body field ``params.structured_outputs`` came from (the
    ``param`` of the line's 400 when the engine cannot compile it). ``response_fields`` are the request
    fields a Responses object repeats (`jobs.schemas.ResponsesBody.echoed_fields`), None on other endpoints.
    """

    endpoint: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    echo: bool = False
    structured_outputs_param: str | None = None
    response_fields: dict[str, Any] | None = None


def map_request(endpoint: str, body: Mapping[str, Any], tokenizer: Tokenizer) -> MappedRequest:
    """Map a line body to prompt token ids and sampling parameters.

    Args:
        endpoint: ``"/v1/completions"``, ``"/v1/chat/completions"`` or ``"/v1/responses"``.
        body: the line's ``body`` object (already JSON-decoded).
        tokenizer: the served model's tokenizer (chat template included).

    Raises:
        jobs.errors.InvalidRequest: the endpoint rejects the body; ``param`` names the field.
    """
    parsed = parse_body(endpoint, body)
    # NOTE: an embeddings line never comes here: the runner sends it to `worker.embeddings`.
    assert not isinstance(parsed, EmbeddingBody), f"{endpoint} is not a text generation endpoint"
    constraint = parsed.constraint
    params = SamplingParams(
        **parsed.sampling_kwargs(),
        structured_outputs=None if constraint is None else StructuredOutputsParams(**constraint.kwargs),
    )
    param = None if constraint is None else constraint.param
    if isinstance(parsed, ChatCompletionBody | ResponsesBody):
        text = tokenizer.apply_chat_template(parsed.conversation(), add_generation_prompt=True, tokenize=False)
        # NOTE: the template already holds the special tokens; encoding must not add a second BOS.
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        fields = parsed.echoed_fields() if isinstance(parsed, ResponsesBody) else None
        return MappedRequest(endpoint, text, token_ids, params, structured_outputs_param=param, response_fields=fields)
    echo = bool(parsed.echo)
    if isinstance(parsed.prompt, str):
        token_ids = tokenizer.encode(parsed.prompt)
        return MappedRequest(endpoint, parsed.prompt, token_ids, params, echo, structured_outputs_param=param)
    return MappedRequest(endpoint, None, list(parsed.prompt), params, echo, structured_outputs_param=param)
