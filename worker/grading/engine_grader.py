"""The `ModelGrader` on this worker's own engine: a grader conversation becomes a chat line.

The conversation goes through the same parse and mapping as a ``/v1/chat/completions`` batch line
(`worker.request_mapping.map_request`: the body's limits, chat template, structured outputs), so a grader
model gets exactly what a batch line with the same body would. A grading task runs between shards on the
engine's process (Celery's solo pool: nothing else steps the engine meanwhile), so the request is run to
its end directly. The engine is built on first use (`worker.bootstrap.get_engine`), so graders that need
no model never load it.
"""

from __future__ import annotations

from typing import Any, Protocol

from jobs.config import get_settings
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
    """Answers grader conversations with ``engine`` (default: this process's, built on first use).

    ``model`` is the served model's name, put in the body as a batch line would have it (default: the
    settings' ``served_model_name``).
    """

    def __init__(self, engine: GeneratingEngine | None = None, *, model: str | None = None) -> None:
        self._engine = engine
        self._model = model

    @property
    def engine(self) -> GeneratingEngine:
        """The engine, built on first use (`worker.bootstrap.get_engine`).

        Raises:
            RuntimeError: this worker serves an embedding model, which cannot answer a grader.
        """
        if self._engine is None:
            from worker.bootstrap import get_engine
            from worker.engine.pooling_engine import PoolingEngine

            engine = get_engine()
            if isinstance(engine, PoolingEngine):
                raise RuntimeError(
                    f"model graders need a generate model; this worker serves {self.model!r}, an embedder"
                )
            self._engine = engine
        return self._engine

    @property
    def model(self) -> str:
        """The model name the grader's chat body carries."""
        return self._model or get_settings().served_model_name

    def generate(
        self,
        messages: list[dict[str, Any]],
        *,
        response_format: dict[str, Any] | None,
        sampling_params: dict[str, Any],
    ) -> str:
        """The reply text (the first choice's); see `worker.grading.model_graders.ModelGrader`.

        Raises:
            jobs.errors.InvalidRequest: the body is refused (e.g. a bad sampling parameter).
            worker.engine.errors.PromptTooLongError: the rendered conversation does not fit the context.
            ValueError: the engine cannot compile the response format.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            **{name: value for name, value in sampling_params.items() if value is not None},
        }
        if response_format is not None:
            body["response_format"] = response_format
        engine = self.engine
        request = map_request(CHAT_COMPLETIONS, body, engine.tokenizer)
        (output,) = engine.generate([request.prompt_token_ids], request.params)
        return output.outputs[0].text if output.outputs else ""
