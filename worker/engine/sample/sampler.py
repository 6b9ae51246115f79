"""Token sampling: logit processors, temperature/top-k/top-p/min-p, per-sequence generators, logprobs.

Semantics follow vLLM's sampler (``vllm/v1/sample/sampler.py`` and its V0 predecessor): per row, in order,
``logit_bias`` -> min-tokens masking of stop/EOS ids -> repetition/presence/frequency penalties ->
greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw with the row's own ``torch.Generator``.
Logprobs are always the log-softmax of the *raw* logits (before any processing), as vLLM V1 returns them.

Reproducibility: a non-greedy row draws exactly one uniform number per step from its own generator and
turns it into a token by inverse-CDF lookup over its own probability row, so a seeded sequence gives the
same tokens whatever other rows share the batch and at whatever row position it sits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.sample.metadata import SamplerOutput, SamplingMetadata
from worker.engine.sample.ops.penalties import apply_logit_bias, apply_min_tokens, apply_penalties, has_penalties
from worker.engine.sample.ops.topk_topp import truncated_logits
from worker.engine.sampling_params import SamplingParams

# Tokens per chunk of the two-level inverse-CDF draw (chunk sums, then a cumsum inside one chunk).
_DRAW_CHUNK = 256


def make_generator(
    seed: int | None, sample_index: int, prompt_token_ids: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Generator:
    """Return the generator of one sequence: sample ``sample_index`` (0-based) of a request with this prompt.

    A seeded generator depends on ``(seed, prompt_token_ids, sample_index)`` only, never on batch
    position: the three are mixed through BLAKE2b (the ids as fixed-width 64-bit integers, so no two
    inputs share an encoding), so the same request with the same seed reproduces, ``n`` samples of one
    request get distinct streams, and lines that share a seed but not a prompt draw independent numbers
    (a job that sets one seed on every line must not give every line the same random draws).
    ``seed=None`` gives a fresh random seed.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        digest = hashlib.blake2b(f"{seed}:{sample_index}:".encode(), digest_size=8)
        digest.update(array("q", prompt_token_ids).tobytes())
        generator.manual_seed(int.from_bytes(digest.digest(), "little"))
    return generator


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], num_top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Logprobs of prompt tokens (completions ``echo`` + ``logprobs``, vLLM's ``prompt_logprobs``).

    Args:
        logits: float32 ``[P, vocab_size]``; row ``j`` is the model's prediction after prompt position ``j``.
        target_token_ids: the ``P`` tokens actually found next in the prompt.
        num_top: number of top alternatives per position (``0`` = none).

    Returns:
        per position ``(raw logprob of the target token, [(token_id, raw logprob)] * num_top)``.

    Raises:
        ValueError: if ``len(target_token_ids)`` differs from the number of logits rows.
    """
    if logits.shape[0] != len(target_token_ids):
        raise ValueError(f"got {logits.shape[0]} logits rows for {len(target_token_ids)} target tokens")
    if not target_token_ids:
        return []
    lse = torch.logsumexp(logits, dim=-1)
    targets = torch.tensor(target_token_ids, dtype=torch.long, device=logits.device)
    target_logprobs = (logits.gather(1, targets[:, None]).squeeze(1) - lse).tolist()
    if num_top <= 0:
        return [(lp, []) for lp in target_logprobs]
    top = logits.topk(min(num_top, logits.shape[1]), dim=-1)
    values: list[list[float]] = (top.values - lse[:, None]).tolist()
    ids: list[list[int]] = top.indices.tolist()
    return [
        (lp, list(zip(row_ids, row_values, strict=True)))
        for lp, row_ids, row_values in zip(target_logprobs, ids, values, strict=True)
    ]


@dataclass(slots=True)
class _RowPlan:
    """Which rows need which processing this step (row indices into the logits)."""

    bias_rows: list[int]
    min_tokens_rows: list[int]
    penalty_rows: list[int]
    random_rows: list[int]

    @classmethod
    def build(cls, metadata: SamplingMetadata) -> _RowPlan:
        plan = cls([], [], [], [])
        for i, p in enumerate(metadata.params):
            if p.logit_bias:
                plan.bias_rows.append(i)
            if p.min_tokens and len(metadata.output_token_ids[i]) < p.min_tokens:
                plan.min_tokens_rows.append(i)
            if has_penalties(p):
                plan.penalty_rows.append(i)
            if not p.is_greedy:
                plan.random_rows.append(i)
        return plan

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.bias_rows or self.min_tokens_rows or self.penalty_rows)


class Sampler:
    """Turns a step's logits into tokens (stateless; one instance per model runner)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        All-greedy batches without bias, penalties or active min-tokens take one batched argmax.

        Args:
            logits: float32 ``[num_rows, vocab_size]``, one row per sequence sampled this step; not mutated.
            metadata: per-row parameters, generators and token histories (``len(params) == num_rows``).

        Returns:
            ids, raw logprobs of the sampled ids and top logprobs (see :class:`SamplerOutput`).

        Raises:
            ValueError: on a row-count mismatch, or a ``logit_bias`` token id outside the vocabulary.
        """
        _check_rows(logits, metadata)
        plan = _RowPlan.build(metadata)
        processed = _process_logits(logits, metadata, plan)
        if not plan.random_rows:
            sampled = processed.argmax(dim=-1)
        else:
            scaled = truncated_logits(processed, metadata.params, plan.random_rows)
            drawn = _draw(scaled, [metadata.generators[i] for i in plan.random_rows])
            if len(plan.random_rows) == logits.shape[0]:
                sampled = drawn
            else:
                row_idx = torch.tensor(plan.random_rows, dtype=torch.long, device=logits.device)
                sampled = processed.argmax(dim=-1).index_copy_(0, row_idx, drawn)

        if not any(p.needs_sampled_logprobs for p in metadata.params):
            return SamplerOutput(sampled.tolist(), None, [None] * len(metadata.params))
        raw_lse = torch.logsumexp(logits, dim=-1)
        sampled_logprobs = logits.gather(1, sampled[:, None]).squeeze(1) - raw_lse
        return SamplerOutput(
            sampled_token_ids=sampled.tolist(),
            logprobs=sampled_logprobs.tolist(),
            top_logprobs=_top_logprobs(logits, raw_lse, metadata.params),
        )

    def probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row is sampled from: float32 ``[num_rows, vocab_size]``.

        Non-greedy rows: softmax of the processed, temperature-scaled, top-k/top-p/min-p-masked logits.
        Greedy rows: one-hot at the processed argmax. This is the target distribution ``p`` of the
        speculative-decoding acceptance rule (Leviathan et al. 2023); ``logits`` is not mutated.

        Raises:
            ValueError: as :meth:`__call__`.
        """
        _check_rows(logits, metadata)
        plan = _RowPlan.build(metadata)
        processed = _process_logits(logits, metadata, plan)
        probs = torch.zeros_like(processed).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
        if plan.random_rows:
            row_idx = torch.tensor(plan.random_rows, dtype=torch.long, device=logits.device)
            random_probs = torch.softmax(truncated_logits(processed, metadata.params, plan.random_rows), dim=-1)
            probs.index_copy_(0, row_idx, random_probs)
        return probs


def _check_rows(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    num_rows = logits.shape[0]
    for name in ("params", "generators", "prompt_token_ids", "output_token_ids"):
        if len(getattr(metadata, name)) != num_rows:
            raise ValueError(f"got {num_rows} logits rows but {len(getattr(metadata, name))} {name}")


def _process_logits(logits: torch.Tensor, metadata: SamplingMetadata, plan: _RowPlan) -> torch.Tensor:
    """logit_bias -> min-tokens masking -> penalties on a copy (``logits`` itself when nothing applies)."""
    if not plan.needs_logits_processing:
        return logits
    processed = logits.clone()
    apply_logit_bias(processed, metadata.params, plan.bias_rows)
    apply_min_tokens(processed, metadata, plan.min_tokens_rows)
    apply_penalties(processed, metadata, plan.penalty_rows)
    return processed


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``softmax(logits)`` by inverse-CDF lookup of one uniform number.

    Per row the result depends only on that row's logits and its generator's state, never on the other
    rows (vLLM draws exponentials for a race instead; one uniform per row is far cheaper on CPU). The
    CDF is two-level: cumulative chunk sums locate the chunk, a cumsum inside that chunk the token.

    Args:
        logits: ``[R, vocab_size]`` truncated logits (``-inf`` = excluded); not mutated.
        generators: one per row; ``None`` draws from torch's default generator.

    Returns:
        long ``[R]`` token ids, always of non-zero probability.
    """
    num_rows, vocab_size = logits.shape
    weights = torch.softmax(logits, dim=-1)
    num_chunks = -(-vocab_size // _DRAW_CHUNK)
    if num_chunks * _DRAW_CHUNK != vocab_size:
        weights = torch.nn.functional.pad(weights, (0, num_chunks * _DRAW_CHUNK - vocab_size))
    chunks = weights.view(num_rows, num_chunks, _DRAW_CHUNK)
    chunk_cdf = chunks.sum(dim=-1).cumsum_(dim=-1)
    uniform = _uniform_per_row(generators, logits.device)
    # NOTE: u * total < total for u < 1, so some chunk's cumulative mass exceeds the target.
    targets = uniform[:, None] * chunk_cdf[:, -1:]
    chunk_idx = torch.searchsorted(chunk_cdf, targets, right=True).clamp_(max=num_chunks - 1)
    mass_before = torch.where(
        chunk_idx > 0, chunk_cdf.gather(1, (chunk_idx - 1).clamp(min=0)), torch.zeros_like(targets)
    )
    rows = torch.arange(num_rows, device=logits.device)
    in_chunk = chunks[rows, chunk_idx.squeeze(1)]
    offset = torch.searchsorted(in_chunk.cumsum(dim=-1), targets - mass_before, right=True)
    # Rounding between chunk sums and the in-chunk cumsum can push the target past the chunk's end:
    # fall back to the chunk's last token of non-zero probability.
    last_nonzero = _DRAW_CHUNK - 1 - (in_chunk > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    offset = torch.minimum(offset, last_nonzero)
    return (chunk_idx * _DRAW_CHUNK + offset).squeeze(1)


def _uniform_per_row(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) float32 per row: from the row's generator, or torch's default one when it has none."""
    values = torch.empty(len(generators), dtype=torch.float32, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        values[unseeded] = torch.rand(len(unseeded), device=device)
    for j, g in enumerate(generators):
        if g is not None:
            values[j] = torch.rand(1, generator=g, device=g.device).to(device)[0]
    return values


def _top_logprobs(
    logits: torch.Tensor, raw_lse: torch.Tensor, params: list[SamplingParams]
) -> list[list[tuple[int, float]] | None]:
    """Top ``params.logprobs`` raw logprobs per row (one batched ``topk`` over the rows that ask)."""
    result: list[list[tuple[int, float]] | None] = [None if p.logprobs is None else [] for p in params]
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return result
    num_top = min(max(params[i].logprobs or 0 for i in rows), logits.shape[1])
    row_idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    top = logits.index_select(0, row_idx).topk(num_top, dim=-1)
    values: list[list[float]] = (top.values - raw_lse.index_select(0, row_idx)[:, None]).tolist()
    ids: list[list[int]] = top.indices.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        result[i] = list(zip(ids[j][:k], values[j][:k]))
    return result
