"""Build OpenAI response bodies from engine outputs: `text_completion`, `chat.completion`, `response`, errors.

Shapes follow OpenAI's API reference; where it is silent, vLLM's OpenAI server
(`serving_completion.py`, `serving_chat.py`):
- completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``; each
  ``top_logprobs`` entry maps decoded token -> logprob for the k most likely tokens plus the sampled
  one (so up to k+1 entries); ``text_offset`` counts characters from the start of the choice's text.
  With ``echo`` the prompt's tokens come first, the very first one with a null logprob.
- chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}``;
  ``bytes`` are each token's own raw bytes (`worker.token_bytes`), so the ``bytes`` of a completion's
  tokens join into its text even where one character spans several tokens.
- ``usage``: ``{prompt_tokens, completion_tokens (all choices), total_tokens,
  prompt_tokens_details: {cached_tokens}}``.
- ``-inf`` logprobs (a token masked out) are written as -9999.0, vLLM's clamp: JSON has no infinity.
- Responses API (``/v1/responses``): a ``response`` object as the ``openai`` SDK's
  ``openai.types.responses.Response`` parses it: one ``message`` output item with one ``output_text``
  part; ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens" when the answer
  was cut by the token limit; ``usage {input_tokens, input_tokens_details {cached_tokens,
  cache_write_tokens: 0}, output_tokens, output_tokens_details {reasoning_tokens: 0}, total_tokens}``;
  the request's fields repeated (`jobs.schemas.ResponsesBody.echoed_fields`). ``output_text`` is the
  SDK's property over ``output``, not a field of the object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

from jobs.schemas import CHAT_COMPLETIONS, RESPONSES
from worker.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from worker.request_mapping import MappedRequest
from worker.token_bytes import TokenBytes, TokenStore

_MIN_LOGPROB = -9999.0


class Decoder(TokenStore, Protocol):
    """The slice of a Hugging Face tokenizer this module uses."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


def build_body(
    output: RequestOutput,
    mapped: MappedRequest,
    *,
    model: str,
    tokenizer: Decoder,
    created: int | None = None,
) -> dict[str, Any]:
    """The response body for one finished request, in the shape of its endpoint.

    Args:
        output: the request's finished `RequestOutput` (one `CompletionOutput` per choice).
        mapped: the line as it was fed to the engine (endpoint, echo, logprob settings).
        model: the served model name to report.
        tokenizer: decodes token ids that carry no decoded text (echoed prompts given as ids) and
            gives chat logprobs' token bytes.
        created: unix seconds; now when None.
    """
    created = int(time.time()) if created is None else created
    if mapped.endpoint == CHAT_COMPLETIONS:
        return chat_completion_body(output, mapped, model=model, tokenizer=tokenizer, created=created)
    if mapped.endpoint == RESPONSES:
        return response_object(output, mapped, model=model, created=created)
    return completion_body(output, mapped, model=model, tokenizer=tokenizer, created=created)


def completion_body(
    output: RequestOutput, mapped: MappedRequest, *, model: str, tokenizer: Decoder, created: int
) -> dict[str, Any]:
    """A ``text_completion`` object (OpenAI legacy completions)."""
    want_logprobs = mapped.params.logprobs is not None
    prompt_text = ""
    if mapped.echo:
        prompt_text = mapped.prompt if mapped.prompt is not None else tokenizer.decode(output.prompt_token_ids)
    choices = []
    for completion in _by_index(output.outputs):
        logprobs = None
        if want_logprobs:
            logprobs = _completion_logprobs(output, completion, mapped, tokenizer)
        choices.append(
            {
                "index": completion.index,
                "text": prompt_text + completion.text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(output),
        "system_fingerprint": None,
    }


def chat_completion_body(
    output: RequestOutput, mapped: MappedRequest, *, model: str, tokenizer: Decoder, created: int
) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    num_top = mapped.params.logprobs
    token_bytes = TokenBytes(tokenizer)
    choices = []
    for completion in _by_index(output.outputs):
        logprobs = None
        if num_top is not None:
            logprobs = {"content": _chat_logprobs(completion, num_top, token_bytes), "refusal": None}
        choices.append(
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(output),
        "system_fingerprint": None,
    }


def response_object(output: RequestOutput, mapped: MappedRequest, *, model: str, created: int) -> dict[str, Any]:
    """A Responses API ``response`` object (one answer: Responses lines take no ``n``)."""
    (completion,) = output.outputs
    truncated = completion.finish_reason == "length"
    status = "incomplete" if truncated else "completed"
    counts = usage(output)
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": created,
        "completed_at": None if truncated else int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "model": model,
        "output": [
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": completion.text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": None,
        "reasoning": None,
        "truncation": "disabled",
        "usage": {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"],
        },
        **(mapped.response_fields or {}),
    }


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI ``usage``: completion tokens summed over every choice."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def context_length_message(num_prompt_tokens: int, max_model_len: int) -> str:
    """OpenAI's wording for a prompt that leaves no room in the context; names both numbers."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
        f"{num_prompt_tokens} tokens, which leaves no room to generate. Please reduce the length of the prompt."
    )


def _by_index(outputs: list[CompletionOutput]) -> list[CompletionOutput]:
    return sorted(outputs, key=lambda c: c.index)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)[:k]


def _completion_logprobs(
    output: RequestOutput, completion: CompletionOutput, mapped: MappedRequest, tokenizer: Decoder
) -> dict[str, Any]:
    k = mapped.params.logprobs or 0
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []

    def add(token_id: int, position: PositionLogprobs | None) -> None:
        if position is None or token_id not in position:
            tokens.append(tokenizer.decode([token_id]))
            token_logprobs.append(None)
            top_logprobs.append(None)
            return
        chosen = position[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(_clamp(chosen.logprob))
        entries = {lp.decoded_token: _clamp(lp.logprob) for _, lp in _top(position, k)}
        entries.setdefault(chosen.decoded_token, _clamp(chosen.logprob))
        top_logprobs.append(entries)

    if mapped.echo:
        prompt_logprobs = output.prompt_logprobs or []
        for idx, token_id in enumerate(output.prompt_token_ids):
            add(token_id, prompt_logprobs[idx] if idx < len(prompt_logprobs) else None)
    for idx, token_id in enumerate(completion.token_ids):
        add(token_id, completion.logprobs[idx] if completion.logprobs and idx < len(completion.logprobs) else None)

    text_offset = []
    offset = 0
    for token in tokens:
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _chat_logprobs(completion: CompletionOutput, k: int, token_bytes: TokenBytes) -> list[dict[str, Any]]:
    content = []
    for idx, token_id in enumerate(completion.token_ids):
        assert completion.logprobs is not None and token_id in completion.logprobs[idx], (
            "the engine returns the sampled token's logprob at every generated position"
        )
        position = completion.logprobs[idx]
        content.append(
            {
                **_chat_token(token_id, position[token_id], token_bytes),
                "top_logprobs": [_chat_token(top_id, lp, token_bytes) for top_id, lp in _top(position, k)],
            }
        )
    return content


def _chat_token(token_id: int, logprob: Logprob, token_bytes: TokenBytes) -> dict[str, Any]:
    return {
        "token": logprob.decoded_token,
        "logprob": _clamp(logprob.logprob),
        "bytes": list(token_bytes(token_id, logprob.decoded_token)),
    }
