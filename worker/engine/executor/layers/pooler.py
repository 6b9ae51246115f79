"""Pooling: one vector per packed sequence from its last hidden states (vLLM's ``Pooler``).

The method is the model's own: a sentence-transformers folder names it in ``modules.json`` (its Pooling
module's ``config.json``: mean, CLS or last token) and says whether a ``Normalize`` module follows. A
folder without that configuration gets vLLM's defaults: CLS for an encoder, the last token for a decoder
(the Qwen3-Embedding recipe), normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.nn import functional as F

PoolingType = Literal["mean", "cls", "last"]

_ST_MODULES = "modules.json"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' Pooling config flag -> our pooling type
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How a model's hidden states become an embedding: ``pooling_type`` and whether to L2-normalise."""

    pooling_type: PoolingType
    normalize: bool


def pooling_config_of(model_dir: Path, *, is_encoder: bool) -> PoolingConfig:
    """The pooling a model folder asks for (module docstring).

    Raises:
        ValueError: the sentence-transformers Pooling module asks for a mode not served (max,
            mean-sqrt-len, weighted mean) or for several at once.
    """
    modules_file = model_dir / _ST_MODULES
    if not modules_file.is_file():
        return PoolingConfig("cls" if is_encoder else "last", normalize=True)
    modules = json.loads(modules_file.read_text())
    types = [module["type"] for module in modules]
    pooling_type: PoolingType = "cls" if is_encoder else "last"
    for module in modules:
        if module["type"] != _ST_POOLING:
            continue
        config = json.loads((model_dir / module["path"] / "config.json").read_text())
        asked = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value)
        served = [key for key in asked if key in _ST_MODES]
        if len(asked) != 1 or not served:
            raise ValueError(f"sentence-transformers pooling {asked} is not served (one of {sorted(_ST_MODES)} is)")
        pooling_type = _ST_MODES[served[0]]
    return PoolingConfig(pooling_type, normalize=_ST_NORMALIZE in types)


def pool(hidden_states: torch.Tensor, seq_lens: list[int], pooling_type: PoolingType) -> torch.Tensor:
    """One row per sequence of the packed ``hidden_states``.

    Args:
        hidden_states: ``[num_tokens, hidden_size]``, sequence after sequence (no padding).
        seq_lens: tokens per sequence (host list), summing to ``num_tokens``.
        pooling_type: ``"mean"`` (average of every token, as sentence-transformers with an all-ones
            attention mask), ``"cls"`` (the first token) or ``"last"`` (the last token).

    Returns:
        float32 ``[num_seqs, hidden_size]``.
    """
    lens = torch.tensor(seq_lens, dtype=torch.long, device=hidden_states.device)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "cls":
        return hidden_states.index_select(0, ends - lens).float()
    if pooling_type == "last":
        return hidden_states.index_select(0, ends - 1).float()
    segment = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden_states.device), lens)
    sums = hidden_states.new_zeros(len(seq_lens), hidden_states.shape[1], dtype=torch.float32)
    sums.index_add_(0, segment, hidden_states.float())
    return sums / lens.unsqueeze(1)


def finish_embeddings(pooled: torch.Tensor, *, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Shorten (Matryoshka: the first ``dimensions`` entries, then normalise as vLLM does) and L2-normalise.

    ``pooled: float32 [num_seqs, hidden_size]`` -> float32 ``[num_seqs, dimensions or hidden_size]``.
    """
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
