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
import math
from dataclasses import dataclass

import torch

from worker.engine.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5
# First candidate-set size tried for the top-p nucleus (enough for the peaked distributions LLMs give).
_TOP_P_INITIAL_CANDIDATES = 64
# Tokens per chunk of the two-level inverse-CDF draw (chunk sums, then a cumsum inside one chunk).
_DRAW_CHUNK = 256


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling inputs for one step (row ``i`` describes row ``i`` of the logits).

    ``generators[i]`` may be ``None`` for greedy rows; a non-greedy row with ``None`` draws from torch's
    default generator (unreproducible). ``prompt_token_ids``/``output_token_ids`` feed the penalties
    (repetition counts prompt + output tokens, as vLLM; presence/frequency count output tokens only) and
    min-tokens masking; ``eos_token_id`` is masked together with ``params.stop_token_ids`` while
    ``len(output_token_ids[i]) < params.min_tokens``, unless ``params.ignore_eos``.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_id: int | None


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, its raw logprob, and the requested top alternatives.

    ``logprobs`` is ``None`` when no row of the step asked for logprobs (the vocabulary-wide log-sum-exp
    is then skipped). ``top_logprobs[i]`` holds ``params.logprobs`` pairs ``(token_id, raw logprob)`` in
    descending order (an empty list for ``logprobs=0``), or ``None`` when the row asked for no logprobs.
    """

    sampled_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int | None, sample_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Return the generator of one sequence: sample ``sample_index`` (0-based) of a request.

    A seeded generator depends on ``(seed, sample_index)`` only (mixed through BLAKE2b so that
    ``(seed, i)`` and ``(seed + 1, i - 1)`` do not collide), never on batch position; ``n`` samples of one
    request therefore get distinct, reproducible streams. ``seed=None`` gives a fresh random seed.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
        generator.manual_seed(int.from_bytes(digest, "little"))
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
    values, ids = logits.topk(min(num_top, logits.shape[1]), dim=-1)
    values = (values - lse[:, None]).tolist()
    ids = ids.tolist()
    return [(lp, list(zip(row_ids, row_values))) for lp, row_ids, row_values in zip(target_logprobs, ids, values)]


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or abs(params.repetition_penalty - 1.0) > _SAMPLING_EPS
    )


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
            if _has_penalties(p):
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
            scaled = _truncated_logits(processed, metadata.params, plan.random_rows)
            drawn = _draw(scaled, [metadata.generators[i] for i in plan.random_rows])
            if len(plan.random_rows) == logits.shape[0]:
                sampled = drawn
            else:
                row_idx = torch.tensor(plan.random_rows, dtype=torch.long, device=logits.device)
                sampled = processed.argmax(dim=-1).index_copy_(0, row_idx, drawn)

        if all(p.logprobs is None for p in metadata.params):
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
            random_probs = torch.softmax(_truncated_logits(processed, metadata.params, plan.random_rows), dim=-1)
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
    _apply_logit_bias(processed, metadata.params, plan.bias_rows)
    _apply_min_tokens(processed, metadata, plan.min_tokens_rows)
    _apply_penalties(processed, metadata, plan.penalty_rows)
    return processed


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
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


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
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


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> None:
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

    if any(abs(p.repetition_penalty - 1.0) > _SAMPLING_EPS for p in params):
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


def _truncated_logits(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p on ``rows``: returns a new ``[len(rows), vocab_size]`` tensor.

    Masked tokens are ``-inf``; softmax of the result is the distribution the rows are sampled from.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    row_params = [params[i] for i in rows]
    temperature = torch.tensor([p.temperature for p in row_params], dtype=torch.float32, device=device)
    if len(rows) == logits.shape[0]:
        scaled = logits / temperature[:, None]
    else:
        row_idx = torch.tensor(rows, dtype=torch.long, device=device)
        scaled = logits.index_select(0, row_idx).div_(temperature[:, None])

    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in row_params]
    top_p = [p.top_p for p in row_params]
    if any(top_k) or any(tp < 1.0 - _SAMPLING_EPS for tp in top_p):
        _apply_top_k_top_p(scaled, top_k, top_p)
    min_p = [p.min_p for p in row_params]
    if any(mp > _SAMPLING_EPS for mp in min_p):
        _apply_min_p(scaled, min_p)
    return scaled


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


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Top-k, then nucleus top-p (Holtzman et al. 2019) over the top-k renormalised row, in place.

    vLLM's rules: top-k keeps logits >= the row's k-th largest (``k == 0`` disables); top-p keeps a token
    when the probability mass ranked above it is < ``top_p`` (so the top token always survives). Instead
    of vLLM's full sort, one ``topk`` over a candidate set yields both thresholds: ``max(top_k)`` tokens,
    at least 64 for top-p rows; if a top-p row's nucleus does not fit, every token with probability
    >= ``(1 - top_p) / vocab_size`` (a token below that has more than ``top_p`` of mass ranked above it, so
    it is never kept). Tokens tied with the last kept one are kept too.

    Args:
        logits: ``[R, vocab_size]`` temperature-scaled logits (mutated).
        top_k: per row, ``0`` or ``1 <= k < vocab_size``.
        top_p: per row, in ``(0, 1]``; ``1`` disables.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    rows = [j for j in range(len(top_k)) if top_k[j] or top_p[j] < 1.0 - _SAMPLING_EPS]
    subset = len(rows) < len(top_k)
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, row_idx) if subset else logits
    k_list = [top_k[j] for j in rows]
    p_list = [top_p[j] if top_p[j] < 1.0 - _SAMPLING_EPS else 1.0 for j in rows]
    k = torch.tensor(k_list, dtype=torch.long, device=device)
    p = torch.tensor(p_list, dtype=torch.float32, device=device)
    uses_p = p < 1.0
    top_p_without_k = any(pj < 1.0 and kj == 0 for pj, kj in zip(p_list, k_list))

    num_candidates = max(k_list)
    if top_p_without_k:
        num_candidates = max(num_candidates, min(vocab_size, _TOP_P_INITIAL_CANDIDATES))
        row_lse = torch.logsumexp(sub, dim=-1)
    candidates, k_threshold = _top_k_candidates(sub, k, num_candidates)
    if any(pj < 1.0 for pj in p_list):
        # Normaliser of each row after top-k: over the candidates for top-k rows, the full row otherwise.
        lse = torch.logsumexp(candidates, dim=-1)
        if top_p_without_k:
            lse = torch.where(k > 0, lse, row_lse)
        candidate_probs = (candidates - lse[:, None]).exp_()
        cumulative = candidate_probs.cumsum(dim=-1)
        unfit = uses_p & (cumulative[:, -1] < p)
        if bool(unfit.any()):
            floor = lse + torch.log((1.0 - p) / vocab_size)
            needed = ((sub >= floor[:, None]) & unfit[:, None]).sum(dim=-1).max()
            candidates, k_threshold = _top_k_candidates(sub, k, max(num_candidates, int(needed)))
            candidate_probs = (candidates - lse[:, None]).exp_()
            cumulative = candidate_probs.cumsum(dim=-1)
        num_kept = ((cumulative - candidate_probs) < p[:, None]).sum(dim=-1, keepdim=True)
        p_threshold = candidates.gather(1, num_kept - 1).squeeze(1)
        k_threshold = torch.where(uses_p, torch.maximum(k_threshold, p_threshold), k_threshold)
    sub.masked_fill_(sub < k_threshold[:, None], -math.inf)
    if subset:
        logits.index_copy_(0, row_idx, sub)


def _top_k_candidates(
    logits: torch.Tensor, k: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``num_candidates`` logits per row, descending, with those below each row's k-th set to ``-inf``.

    Returns ``(candidates [R, num_candidates], k-th largest logit [R] or -inf where k == 0)``.
    """
    candidates = logits.topk(num_candidates, dim=-1).values
    k_threshold = candidates.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
    k_threshold = k_threshold.masked_fill_(k == 0, -math.inf)
    candidates.masked_fill_(candidates < k_threshold[:, None], -math.inf)
    return candidates, k_threshold


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Drop tokens whose probability is < ``min_p`` x the top probability, in logit space, in place."""
    scale = torch.tensor(min_p, dtype=torch.float32, device=logits.device).log()
    threshold = logits.amax(dim=-1, keepdim=True) + scale[:, None]
    logits.masked_fill_(logits < threshold, -math.inf)


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
    values, ids = logits.index_select(0, row_idx).topk(num_top, dim=-1)
    values = (values - raw_lse.index_select(0, row_idx)[:, None]).tolist()
    ids = ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        result[i] = list(zip(ids[j][:k], values[j][:k]))
    return result
