"""`worker.model_grader.EngineModelGrader`: a judge request mapped as a chat line and run to its end."""

from __future__ import annotations

from typing import Any

import pytest

from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.model_grader import EngineModelGrader


class _Tokenizer:
    def apply_chat_template(self, conversation: list[dict[str, str]], **_kwargs: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]


class _Engine:
    """Finishes each request on its second step with ``answer``; another request finishes first."""

    tokenizer = _Tokenizer()

    def __init__(self, answer: str, *, drop: bool = False) -> None:
        self.answer, self.drop = answer, drop
        self.added: list[tuple[str, list[int], Any]] = []
        self.num_steps = 0

    def add_request(self, request_id: str, prompt: Any, params: Any, **_kwargs: Any) -> None:
        self.added.append((request_id, prompt, params))

    def has_unfinished_requests(self) -> bool:
        return not self.drop and self.num_steps < 2

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        request_id = self.added[-1][0]
        done = self.num_steps == 2
        other = RequestOutput("other", None, [], [CompletionOutput(0, "x", [1])], finished=True)
        mine = RequestOutput(request_id, None, [], [CompletionOutput(0, self.answer if done else "", [1])], done)
        return [other, mine]


def test_generate_runs_one_chat_request_with_the_sampling_params_and_format() -> None:
    engine = _Engine("positive")
    grader = EngineModelGrader(engine, model_name="m")
    schema = {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]}}, "required": ["label"]}
    answer = grader.generate(
        [{"role": "system", "content": "Label it."}, {"role": "user", "content": "great"}],
        response_format={"type": "json_schema", "json_schema": {"name": "label", "schema": schema}},
        sampling_params={"temperature": 0, "max_completion_tokens": 5, "seed": 3, "unknown": 1},
    )
    assert answer == "positive"
    ((_request_id, prompt, params),) = engine.added
    assert prompt == _Tokenizer().encode("<system>Label it.<user>great")
    assert (params.temperature, params.max_tokens, params.seed) == (0, 5, 3)
    assert params.structured_outputs is not None and params.structured_outputs.json is not None


def test_an_engine_that_drops_the_request_raises() -> None:
    with pytest.raises(RuntimeError, match="dropped"):
        EngineModelGrader(_Engine("x", drop=True), model_name="m").generate(
            [{"role": "user", "content": "hi"}], response_format=None, sampling_params={}
        )
