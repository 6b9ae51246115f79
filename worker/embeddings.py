"""``/v1/embeddings`` lines: a body to checked token ids, and embeddings to OpenAI's response body.

The body is parsed by its schema (`jobs.schemas.EmbeddingBody`, through `jobs.line_body.parse_body`); this
module adds what needs the model: tokenizing texts, the model's length limit and vocabulary, and whether
it can shorten its embeddings (``dimensions``). Every refusal is an `InvalidRequest` (the line's 400).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jobs.errors import InvalidRequest
from jobs.line_body import parse_body
from jobs.schemas import EMBEDDINGS, EmbeddingBody
from worker.engine.errors import InvalidParameterError, PromptTooLongError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class EmbeddingEngine(Protocol):
    """The slice of `worker.engine.pooling_engine.PoolingEngine` the runner drives."""

    hidden_size: int
    max_model_len: int
    matryoshka_dimensions: tuple[int, ...] | None

    def supports_dimensions(self, dimensions: int) -> bool: ...

    def tokenize(self, text: str, truncate_prompt_tokens: int | None = None) -> list[int]: ...

    def check_prompt(self, token_ids: Sequence[int], truncate_prompt_tokens: int | None = None) -> list[int]: ...

    def embed(
        self, prompt_token_ids: Sequence[Sequence[int]], *, dimensions: int | None = None, normalize: bool | None = None
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class EmbeddingRequest:
    """One line ready to embed: the token ids of each input (checked), and how to answer."""

    prompt_token_ids: list[list[int]]
    dimensions: int | None
    encoding_format: str

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


def map_embedding_request(body: dict[str, Any], engine: EmbeddingEngine) -> EmbeddingRequest:
    """Parse and check one ``/v1/embeddings`` body against the served model.

    Raises:
        InvalidRequest: the schema refuses the body; ``dimensions`` the model cannot shorten to
            (``param="dimensions"``); an input longer than the model's limit without ``truncate_prompt_tokens``
            (``code="context_length_exceeded"``), holding a token id outside the vocabulary or empty after
            tokenization (``param="input"``). The message names the input (``input[2]``) when there are several.
    """
    parsed = parse_body(EMBEDDINGS, body)
    assert isinstance(parsed, EmbeddingBody)
    if parsed.dimensions is not None and not engine.supports_dimensions(parsed.dimensions):
        raise InvalidRequest(_dimensions_refused(parsed.dimensions, engine), param="dimensions", code="invalid_value")
    truncate = parsed.truncate_prompt_tokens
    inputs = parsed.inputs()
    token_ids: list[list[int]] = []
    for index, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{index}]"
        ids = engine.tokenize(item, truncate) if isinstance(item, str) else item
        try:
            token_ids.append(engine.check_prompt(ids, truncate))
        except PromptTooLongError as exc:
            raise InvalidRequest(
                f"{where} has {exc.num_prompt_tokens} tokens; this model embeds at most {exc.max_model_len} "
                "(shorten it, or set truncate_prompt_tokens to cut it)",
                param="input",
                code="context_length_exceeded",
            ) from None
        except InvalidParameterError as exc:
            raise InvalidRequest(f"{where}: {exc}", param="input", code="invalid_value") from None
        except ValueError as exc:
            raise InvalidRequest(f"{where}: {exc}", param="input") from None
    return EmbeddingRequest(token_ids, parsed.dimensions, parsed.encoding_format)


def _dimensions_refused(dimensions: int, engine: EmbeddingEngine) -> str:
    """Why ``dimensions`` is refused, naming the widths the model serves."""
    full = engine.hidden_size
    served = engine.matryoshka_dimensions
    if served is None:
        return f"dimensions={dimensions}: this model shortens its {full}-dimension embeddings to at most {full}"
    if served:
        widths = ", ".join(map(str, sorted({*served, full})))
        return f"dimensions={dimensions}: this Matryoshka model serves dimensions {widths} only"
    return (
        f"this model does not support dimensions={dimensions} (it embeds in {full} dimensions and is not a "
        "Matryoshka model that can shorten them); leave dimensions out"
    )


def embedding_body(embeddings: torch.Tensor, request: EmbeddingRequest, *, model: str) -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse`` for one line.

    Args:
        embeddings: float32 ``[num_inputs, dims]``, the line's inputs in order.
        request: the line's mapped request (its ``encoding_format``; its token counts make ``usage``).
        model: the model name the body reports.

    Returns:
        ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}``;
        with ``encoding_format="base64"`` each embedding is the base64 of its little-endian float32 bytes
        (what the openai SDK decodes), else a list of floats.
    """
    rows = embeddings.float().contiguous()
    data: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        vector: list[float] | str
        if request.encoding_format == "base64":
            vector = base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
        else:
            vector = row.tolist()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = request.num_tokens
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
