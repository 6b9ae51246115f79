"""Temperature, then top-k, top-p (nucleus) and min-p truncation of the rows that are sampled at random.

vLLM's rules and order (``vllm/v1/sample/ops/topk_topp_sampler.py``); masked tokens become ``-inf``.
"""

from __future__ import annotations

import math

import torch

from worker.engine.sample.ops.penalties import SAMPLING_EPS
from worker.engine.sample.ops.reductions import logsumexp_rows
from worker.engine.sampling_params import SamplingParams

# First candidate-set size tried for the top-p nucleus (enough for the peaked distributions LLMs give).
_TOP_P_INITIAL_CANDIDATES = 64


def truncated_logits(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
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
    if any(top_k) or any(tp < 1.0 - SAMPLING_EPS for tp in top_p):
        apply_top_k_top_p(scaled, top_k, top_p)
    min_p = [p.min_p for p in row_params]
    if any(mp > SAMPLING_EPS for mp in min_p):
        apply_min_p(scaled, min_p)
    return scaled


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
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
    rows = [j for j in range(len(top_k)) if top_k[j] or top_p[j] < 1.0 - SAMPLING_EPS]
    subset = len(rows) < len(top_k)
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, row_idx) if subset else logits
    k_list = [top_k[j] for j in rows]
    p_list = [top_p[j] if top_p[j] < 1.0 - SAMPLING_EPS else 1.0 for j in rows]
    k = torch.tensor(k_list, dtype=torch.long, device=device)
    p = torch.tensor(p_list, dtype=torch.float32, device=device)
    uses_p = p < 1.0
    top_p_without_k = any(pj < 1.0 and kj == 0 for pj, kj in zip(p_list, k_list))

    num_candidates = max(k_list)
    if top_p_without_k:
        num_candidates = max(num_candidates, min(vocab_size, _TOP_P_INITIAL_CANDIDATES))
        row_lse = logsumexp_rows(sub)
    candidates, k_threshold = _top_k_candidates(sub, k, num_candidates)
    if any(pj < 1.0 for pj in p_list):
        # Normaliser of each row after top-k: over the candidates for top-k rows, the full row otherwise.
        lse = logsumexp_rows(candidates)
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


def _top_k_candidates(logits: torch.Tensor, k: torch.Tensor, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``num_candidates`` logits per row, descending, with those below each row's k-th set to ``-inf``.

    Returns ``(candidates [R, num_candidates], k-th largest logit [R] or -inf where k == 0)``.
    """
    candidates = logits.topk(num_candidates, dim=-1).values
    k_threshold = candidates.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
    k_threshold = k_threshold.masked_fill_(k == 0, -math.inf)
    candidates.masked_fill_(candidates < k_threshold[:, None], -math.inf)
    return candidates, k_threshold


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Drop tokens whose probability is < ``min_p`` x the top probability, in logit space, in place."""
    scale = torch.tensor(min_p, dtype=torch.float32, device=logits.device).log()
    threshold = logits.amax(dim=-1, keepdim=True) + scale[:, None]
    logits.masked_fill_(logits < threshold, -math.inf)
