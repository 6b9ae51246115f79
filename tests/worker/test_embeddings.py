"""`worker.embeddings.map_embedding_request`'s 400s, against a stand-in engine of known widths and vocabulary.

The same refusals through the runner and a real (tiny) model: tests/worker/test_embedding_runner.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from jobs.errors import InvalidRequest
from worker.embeddings import map_embedding_request
from worker.engine.errors import InvalidParameterError


class WidthsEngine:
    """An embedding engine of width 64 and a 100-token vocabulary serving ``matryoshka_dimensions``
    (`PoolingEngine`'s meaning: None any width, an empty tuple none but the full one)."""

    hidden_size = 64
    max_model_len = 16

    def __init__(self, matryoshka_dimensions: tuple[int, ...] | None) -> None:
        self.matryoshka_dimensions = matryoshka_dimensions

    def supports_dimensions(self, dimensions: int) -> bool:
        if dimensions == self.hidden_size:
            return True
        if self.matryoshka_dimensions is None:
            return 1 <= dimensions <= self.hidden_size
        return dimensions in self.matryoshka_dimensions

    def tokenize(self, text: str, truncate_prompt_tokens: int | None = None) -> list[int]:
        return [ord(c) % 100 for c in text]

    def check_prompt(self, token_ids: Sequence[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        if any(not 0 <= i < 100 for i in token_ids):
            raise InvalidParameterError("holds token ids outside the vocabulary [0, 100)", "input")
        return list(token_ids)

    def embed(self, prompt_token_ids, *, dimensions=None, normalize=None):  # pragma: no cover (not called)
        raise AssertionError


def refusal(engine: WidthsEngine, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        map_embedding_request({"model": "m", "input": "text", **fields}, engine)
    return caught.value


def test_dimensions_a_matryoshka_model_does_not_serve_name_the_widths_it_does():
    listed = refusal(WidthsEngine((16, 32)), dimensions=20)
    assert listed.param == "dimensions"
    assert "16, 32" in listed.message and "64" in listed.message and "Matryoshka" in listed.message
    assert "not a Matryoshka model" not in listed.message
    too_wide = refusal(WidthsEngine(None), dimensions=65)
    assert too_wide.param == "dimensions" and "at most 64" in too_wide.message
    assert "not a Matryoshka model" not in too_wide.message
    fixed = refusal(WidthsEngine(()), dimensions=16)
    assert fixed.param == "dimensions" and "not a Matryoshka model" in fixed.message
    for engine, dimensions in ((WidthsEngine((16, 32)), 16), (WidthsEngine(None), 5), (WidthsEngine(()), 64)):
        assert map_embedding_request({"model": "m", "input": "x", "dimensions": dimensions}, engine).dimensions == (
            dimensions
        )
