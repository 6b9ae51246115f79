"""Turn one stored batch line into what the engine takes: prompt token ids + `SamplingParams`.

The body is parsed by its endpoint's schema (`jobs.line_body.parse_body`), which holds every body
rule (limits, defaults, cross-field checks) and gives the `SamplingParams` keyword arguments (vLLM's
``to_sampling_params``). This module adds only what needs the model: the chat template and the
tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from jobs.line_body import parse_body
from jobs.schemas import ChatCompletionBody
from worker.engine import SamplingParams


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
        jobs.errors.InvalidRequest: the endpoint rejects the body; ``param`` names the field.
    """
    parsed = parse_body(endpoint, body)
    params = SamplingParams(**parsed.sampling_kwargs())
    if isinstance(parsed, ChatCompletionBody):
        text = tokenizer.apply_chat_template(parsed.conversation(), add_generation_prompt=True, tokenize=False)
        # NOTE: the template already holds the special tokens; encoding must not add a second BOS.
        return MappedRequest(endpoint, text, tokenizer.encode(text, add_special_tokens=False), params)
    if isinstance(parsed.prompt, str):
        return MappedRequest(endpoint, parsed.prompt, tokenizer.encode(parsed.prompt), params, echo=bool(parsed.echo))
    return MappedRequest(endpoint, None, list(parsed.prompt), params, echo=bool(parsed.echo))
