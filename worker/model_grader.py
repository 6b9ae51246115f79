"""The served model as the model graders' judge (`worker.grading.ModelGrader`): one chat request run to
its end on this worker's engine.

A grading task runs between shards on the engine's process (Celery's solo pool: nothing else steps the
engine meanwhile), so a judge request is added, and the engine stepped until it finishes, directly. The
engine is built on first use (`worker.bootstrap.get_engine`), so graders that need no model never load
it. ``response_format`` is the chat body's (a ``json_schema`` constrains the answer, as a batch line's
does: `jobs.structured_outputs`).
"""

from __future__ import annotations

import uuid
from typing import Any

from jobs.config import get_settings
from jobs.schemas import CHAT_COMPLETIONS
from worker.request_mapping import map_request
from worker.runner import Engine

SAMPLING_FIELDS = ("temperature", "top_p", "seed", "max_completion_tokens", "max_tokens")


class EngineModelGrader:
    """`worker.grading.ModelGrader` over ``engine`` (default: this process's, built on first use)."""

    def __init__(self, engine: Engine | None = None, *, model_name: str | None = None) -> None:
        self._engine = engine
        self._model_name = model_name

    def generate(
        self, messages: list[dict[str, Any]], *, response_format: dict[str, Any] | None, sampling_params: dict[str, Any]
    ) -> str:
        """The answer's text (the first sample) to ``messages`` (chat ``[{role, content}]``).

        Raises:
            jobs.errors.InvalidRequest: the chat body would be refused (``param`` names the field).
            worker.engine.errors.PromptTooLongError: the messages do not fit the model's context.
            RuntimeError: the engine ended without finishing the request.
        """
        engine = self._engine
        if engine is None:
            from worker.bootstrap import get_engine

            engine = self._engine = get_engine()
        body: dict[str, Any] = {
            "model": self._model_name or get_settings().served_model_name,
            "messages": messages,
            **{name: sampling_params[name] for name in SAMPLING_FIELDS if sampling_params.get(name) is not None},
        }
        if response_format is not None:
            body["response_format"] = response_format
        mapped = map_request(CHAT_COMPLETIONS, body, engine.tokenizer)
        request_id = f"grader-{uuid.uuid4().hex}"
        engine.add_request(request_id, mapped.prompt_token_ids, mapped.params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    return output.outputs[0].text if output.outputs else ""
        raise RuntimeError(f"the engine dropped the grader's request {request_id}")
