"""`worker.grading.engine_grader.EngineModelGrader` on a stand-in engine: a judge request mapped as a chat
line and run to its end; the engine and model name come from the worker when not given."""

from __future__ import annotations

from typing import Any

import pytest

from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.grading.engine_grader import EngineModelGrader


class _Tokenizer:
    def apply_chat_template(self, conversation: list[dict[str, str]], **_kwargs: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]


class _Engine:
    """Answers every prompt with ``answer``, recording what it was given."""

    tokenizer = _Tokenizer()

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.generated: list[tuple[list[Any], Any]] = []

    def generate(self, prompts: list[Any], params: Any) -> list[RequestOutput]:
        self.generated.append((prompts, params))
        return [
            RequestOutput(f"r{i}", None, [], [CompletionOutput(0, self.answer, [1])], True) for i in range(len(prompts))
        ]


def test_generate_runs_one_chat_request_with_the_sampling_params_and_format() -> None:
    engine = _Engine("positive")
    grader = EngineModelGrader(engine, model="m")
    schema = {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]}}, "required": ["label"]}
    answer = grader.generate(
        [{"role": "system", "content": "Label it."}, {"role": "user", "content": "great"}],
        response_format={"type": "json_schema", "json_schema": {"name": "label", "schema": schema}},
        sampling_params={"temperature": 0, "max_completion_tokens": 5, "seed": 3, "top_p": None},
    )
    assert answer == "positive"
    ((prompts, params),) = engine.generated
    assert prompts == [_Tokenizer().encode("<system>Label it.<user>great")]
    assert (params.temperature, params.max_tokens, params.seed) == (0, 5, 3)
    assert params.structured_outputs is not None and params.structured_outputs.json is not None


def test_the_engine_is_built_on_first_use_and_the_model_named_by_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import worker.bootstrap

    engine = _Engine("ok")
    built: list[_Engine] = []

    def get_engine() -> _Engine:
        built.append(engine)
        return engine

    monkeypatch.setattr(worker.bootstrap, "get_engine", get_engine)
    grader = EngineModelGrader()
    assert built == []  # a grader that never asks the model never loads it
    assert grader.generate([{"role": "user", "content": "hi"}], response_format=None, sampling_params={}) == "ok"
    assert grader.generate([{"role": "user", "content": "hi"}], response_format=None, sampling_params={}) == "ok"
    assert built == [engine]
    from jobs.config import get_settings

    assert grader.model == get_settings().served_model_name
