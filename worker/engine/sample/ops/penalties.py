"""Logits processors applied before sampling, in vLLM's order: ``logit_bias``, min-tokens masking of
stop/EOS ids, then repetition/presence/frequency penalties. Each works in place on the rows that ask for it."""

from __future__ import annotations

import math

import torch

from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sampling_params import SamplingParams

SAMPLING_EPS = 1e-5


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or abs(params.repetition_penalty - 1.0) > SAMPLING_EPS
    )


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    """Add OpenAI ``logit_bias`` (token id -> additive bias) in place."""
    vocab_size = logits.shape[1]
    for i in rows:
        bias = params[i].logit_bias
        assert bias is not None
        token_ids = list(bias)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})")
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[i].index_add_(0, ids, values)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """Forbid stop token ids (and EOS unless ``ignore_eos``) while fewer than ``min_tokens`` were generated."""
    vocab_size = logits.shape[1]
    for i in rows:
        p = metadata.params[i]
        stop_ids = list(p.stop_token_ids)
        if metadata.eos_token_id is not None and not p.ignore_eos:
            stop_ids.append(metadata.eos_token_id)
        stop_ids = [t for t in stop_ids if 0 <= t < vocab_size]
        if stop_ids:
            logits[i, stop_ids] = -math.inf


def _padded_ids(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into long ``[R, max_len]`` plus a float ``[R, max_len]`` mask of real entries.

    Padding repeats a real id of the row (0 for an empty row) so that scatters stay in range.
    """
    max_len = max((len(ids) for ids in token_lists), default=0)
    padded = [ids + [ids[0] if ids else 0] * (max_len - len(ids)) for ids in token_lists]
    mask = [[1.0] * len(ids) + [0.0] * (max_len - len(ids)) for ids in token_lists]
    shape = (len(token_lists), max_len)
    return (
        torch.tensor(padded, dtype=torch.long, device=device).reshape(shape),
        torch.tensor(mask, dtype=torch.float32, device=device).reshape(shape),
    )


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
    """Repetition (CTRL, Keskar et al. 2019), then OpenAI frequency and presence penalties, in place.

    As vLLM's ``apply_penalties``: for tokens seen in prompt or output, a positive logit is divided by
    ``repetition_penalty`` and a negative one multiplied by it; then
    ``logit -= frequency_penalty * output_count + presence_penalty * (output_count > 0)``.
    Only the seen ids are touched (gather/scatter), never the whole vocabulary row.
    """
    if not rows:
        return
    device = logits.device
    params = [metadata.params[i] for i in rows]
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, row_idx)

    if any(abs(p.repetition_penalty - 1.0) > SAMPLING_EPS for p in params):
        seen = [list(dict.fromkeys(metadata.prompt_token_ids[i] + metadata.output_token_ids[i])) for i in rows]
        seen_ids, _ = _padded_ids(seen, device)
        # Padding repeats a real id, so every write to one id carries the same penalised value; a row
        # with no ids at all (padding only) gets factor 1 and is written back unchanged.
        repetition = torch.tensor(
            [p.repetition_penalty if ids else 1.0 for p, ids in zip(params, seen)], dtype=torch.float32, device=device
        )
        values = sub.gather(1, seen_ids)
        penalised = torch.where(values > 0, values / repetition[:, None], values * repetition[:, None])
        sub.scatter_(1, seen_ids, penalised)

    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
    output_ids, output_mask = _padded_ids([metadata.output_token_ids[i] for i in rows], device)
    sub.scatter_add_(1, output_ids, -frequency[:, None] * output_mask)
    unique_ids, unique_mask = _padded_ids([list(dict.fromkeys(metadata.output_token_ids[i])) for i in rows], device)
    sub.scatter_add_(1, unique_ids, -presence[:, None] * unique_mask)
    logits.index_copy_(0, row_idx, sub)
