"""Token sampling: logit processors, temperature/top-k/top-p/min-p, counter-based random draws, logprobs.

Semantics follow vLLM's sampler (``vllm/v1/sample/sampler.py`` and its V0 predecessor): per row, in order,
``logit_bias`` -> min-tokens masking of stop/EOS ids -> repetition/presence/frequency penalties -> the
structured-output grammar's token bitmask (constrained rows) -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> a draw with the row's own ``torch.Generator``.
Logprobs are always the log-softmax of the *raw* logits (before any processing), as vLLM V1 returns them.

Reproducibility: a non-greedy row draws its token by an exponential race (the Gumbel-max trick) over
counter-based random numbers, a function of the row's sampling key (seed, prompt and sample index), the
index of the token being sampled and the token id only (:func:`kernels.cpu_sampling.exponential_race_cpu`).
A seeded sequence thus gives the same tokens whatever other rows share the batch, at whatever row position,
after a preemption, and a last-bit change of a logit can flip a token only at a near-tie of two scores
(an inverse-CDF lookup flips wherever the cumulative sum crosses the uniform).
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_sampling import argmax_rows_cpu, exponential_race_cpu
from kernels.reference import exponential_race_reference
from worker.engine.sample.metadata import SamplerOutput, SamplingMetadata
from worker.engine.sample.ops.penalties import apply_logit_bias, apply_min_tokens, apply_penalties, has_penalties
from worker.engine.sample.ops.reductions import logsumexp_rows
from worker.engine.sample.ops.topk_topp import truncated_logits
from worker.engine.sampling_params import SamplingParams


def make_sampling_key(seed: int | None, sample_index: int, prompt_token_ids: Sequence[int]) -> int:
    """Return the sampling key of one sequence: sample ``sample_index`` (0-based) of a request with this prompt.

    A seeded key depends on ``(seed, prompt_token_ids, sample_index)`` only, never on batch position: the
    three are mixed through BLAKE2b (the ids as fixed-width 64-bit integers, so no two inputs share an
    encoding), so the same request with the same seed reproduces, ``n`` samples of one request get distinct
    streams, and lines that share a seed but not a prompt draw independent numbers (a job that sets one seed
    on every line must not give every line the same random draws). ``seed=None`` gives a fresh random key.

    Returns:
        a signed 64-bit integer (an int64 tensor holds it).
    """
    if seed is None:
        return int.from_bytes(secrets.token_bytes(8), "little", signed=True)
    digest = hashlib.blake2b(f"{seed}:{sample_index}:".encode(), digest_size=8)
    digest.update(array("q", prompt_token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


# Streams of counter_generator: what the draws are for, so two uses of one key and position never share numbers.
VERIFY_STREAM = 1  # speculative decoding's acceptance test and resample (sample/rejection_sampler.py)
DRAFT_STREAM = 2  # a draft model's own samples (spec_decode/draft_model_proposer.py)


def counter_generator(key: int, counter: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` for draws that are not one token of the race: seeded from a BLAKE2b hash of the
    line's sampling key, an output position and a ``stream`` id, so its numbers depend on those alone (never on
    the batch) and repeat whenever the same position is drawn again (after a preemption, say).

    Args:
        key: the line's sampling key (:func:`make_sampling_key`).
        counter: the output position the draws are for.
        stream: what the draws are for (``VERIFY_STREAM``, ``DRAFT_STREAM``).
    """
    digest = hashlib.blake2b(array("q", [key, counter, stream]).tobytes(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)
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
    lse = logsumexp_rows(logits)
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
    constrained_rows: list[int]

    @classmethod
    def build(cls, metadata: SamplingMetadata) -> _RowPlan:
        plan = cls([], [], [], [], metadata.constrained_rows)
        constrained = set(metadata.constrained_rows)
        for i, p in enumerate(metadata.params):
            if p.logit_bias:
                plan.bias_rows.append(i)
            # NOTE: a grammar decides where a constrained output may end; masking EOS there could leave no token.
            if p.min_tokens and len(metadata.output_token_ids[i]) < p.min_tokens and i not in constrained:
                plan.min_tokens_rows.append(i)
            if has_penalties(p):
                plan.penalty_rows.append(i)
            if not p.is_greedy:
                plan.random_rows.append(i)
        return plan

    @property
    def needs_logits_processing(self) -> bool:
        return bool(self.bias_rows or self.min_tokens_rows or self.penalty_rows or self.constrained_rows)


class Sampler:
    """Turns a step's logits into tokens (stateless; one instance per model runner)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        All-greedy batches without bias, penalties or active min-tokens take one batched argmax.

        Args:
            logits: float32 ``[num_rows, vocab_size]``, one row per sequence sampled this step; not mutated.
            metadata: per-row parameters, sampling keys and token histories (``len(params) == num_rows``).

        Returns:
            ids, raw logprobs of the sampled ids and top logprobs (see :class:`SamplerOutput`).

        Raises:
            ValueError: on a row-count mismatch, or a ``logit_bias`` token id outside the vocabulary.
        """
        _check_rows(logits, metadata)
        plan = _RowPlan.build(metadata)
        processed = _process_logits(logits, metadata, plan)
        if not plan.random_rows:
            sampled = _argmax_rows(processed)
        else:
            scaled = truncated_logits(processed, metadata.params, plan.random_rows)
            drawn = _exponential_race(scaled, metadata, plan.random_rows)
            if len(plan.random_rows) == logits.shape[0]:
                sampled = drawn
            else:
                row_idx = torch.tensor(plan.random_rows, dtype=torch.long, device=logits.device)
                sampled = _argmax_rows(processed).index_copy_(0, row_idx, drawn)

        if not any(p.needs_sampled_logprobs for p in metadata.params):
            return SamplerOutput(sampled.tolist(), None, [None] * len(metadata.params))
        raw_lse = logsumexp_rows(logits)
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


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, through the C++ kernel on CPU (:func:`kernels.cpu_sampling.argmax_rows_cpu`: the
    same indices, a tenth of torch's time on a decode step's 64 x 49,152 logits)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and cpu_kernels_available()
    ):
        return argmax_rows_cpu(logits if logits.stride(1) == 1 else logits.contiguous())
    return logits.argmax(dim=-1)


def _check_rows(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    num_rows = logits.shape[0]
    for name in ("params", "sampling_keys", "prompt_token_ids", "output_token_ids"):
        if len(getattr(metadata, name)) != num_rows:
            raise ValueError(f"got {num_rows} logits rows but {len(getattr(metadata, name))} {name}")


def _process_logits(logits: torch.Tensor, metadata: SamplingMetadata, plan: _RowPlan) -> torch.Tensor:
    """logit_bias -> min-tokens masking -> penalties -> grammar bitmask on a copy (``logits`` itself when nothing
    applies)."""
    if not plan.needs_logits_processing:
        return logits
    processed = logits.clone()
    apply_logit_bias(processed, metadata.params, plan.bias_rows)
    apply_min_tokens(processed, metadata, plan.min_tokens_rows)
    apply_penalties(processed, metadata, plan.penalty_rows)
    if plan.constrained_rows:
        from worker.engine.structured_output.backend_xgrammar import apply_token_bitmask

        assert metadata.token_bitmask is not None
        apply_token_bitmask(processed, metadata.token_bitmask, plan.constrained_rows)
    return processed


def _exponential_race(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """One token per row of ``softmax(logits)``: the exponential race of the rows' keys at their counters.

    Args:
        logits: ``[len(rows), vocab_size]`` truncated logits of the random rows (``-inf`` = excluded).
        metadata: the step's metadata; ``rows`` index its per-row lists.

    Returns:
        long ``[len(rows)]`` token ids, always of non-zero probability.
    """
    device = logits.device
    keys = torch.tensor([metadata.sampling_keys[i] for i in rows], dtype=torch.long, device=device)
    counters = torch.tensor([len(metadata.output_token_ids[i]) for i in rows], dtype=torch.long, device=device)
    if device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels_available():
        return exponential_race_cpu(logits.contiguous(), keys, counters)
    return exponential_race_reference(logits, keys, counters)


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
