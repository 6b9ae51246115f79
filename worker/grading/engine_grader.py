"""The `ModelGrader` on this worker's own engine: a grader conversation becomes a chat line.

The conversation goes through the same parse and mapping as a ``/v1/chat/completions`` batch line
(`worker.request_mapping.map_request`: the body's limits, chat template, structured outputs), so a grader
model gets exactly what a batch line with the same body would.
"""

from __future__ import annotations

from typing import Any, Protocol

from jobs.schemas import CHAT_COMPLETIONS
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.request_mapping import map_request


class GeneratingEngine(Protocol):
    """The slice of `worker.engine.llm_engine.LLMEngine` a grader uses."""

    tokenizer: Any

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]: ...


class EngineModelGrader:
    """Answers grader conversations with ``engine`` (usually `worker.bootstrap.get_engine()`).

    ``model`` is the served model's name, put in the body as a batch line would have it.
    """

    def __init__(self, engine: GeneratingEngine, *, model: str) -> None:
        self.engine = engine
        self.model = model

    def generate(
        self,
        messages: list[dict[str, Any]],
        *,
        response_format: dict[str, Any] | None,
        sampling_params: dict[str, Any],
    ) -> str:
        """The reply text; see `worker.grading.model_graders.ModelGrader`.

        Raises:
            jobs.errors.InvalidRequest: the body is refused (e.g. a bad sampling parameter).
            worker.engine.errors.PromptTooLongError: the rendered conversation does not fit the context.
            ValueError: the engine cannot compile the response format.
        """
        body: dict[str, Any] = {"model": self.model, "messages": messages, **sampling_params}
        if response_format is not None:
            body["response_format"] = response_format
        request = map_request(CHAT_COMPLETIONS, body, self.engine.tokenizer)
        (output,) = self.engine.generate([request.prompt_token_ids], request.params)
        return output.outputs[0].text
