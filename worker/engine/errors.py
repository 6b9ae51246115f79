"""Errors the engine raises for bad input."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate: ``num_prompt_tokens >= max_model_len``.

    The API maps it to a 400 response for that line (the line, not the batch, fails).
    """

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens but the model's context is {max_model_len} tokens "
            f"(prompt plus at least one generated token must fit)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class InvalidParameterError(ValueError):
    """A request parameter that only the loaded model can check (token ids against its vocabulary).

    ``param`` names the offending field (``"prompt"``, ``"logit_bias"``); the worker fails that line
    alone with a 400 ``invalid_value`` error, before it joins a batch.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ResumeError(ValueError):
    """A request cannot resume from the generated tokens it was given (`LLMEngine.add_request`'s
    ``resumed_token_ids``): its parameters do not allow it (logprobs, several sampled branches, beam
    search, structured outputs), an id is outside the vocabulary, or the tokens already finish it.

    The caller starts the request afresh instead; nothing of the request is in the engine.
    """
