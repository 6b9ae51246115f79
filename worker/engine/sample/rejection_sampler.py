"""Verification of draft tokens: the rejection sampler of speculative decoding.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" (algorithm 1), and
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"; vLLM's
``RejectionSampler`` layout. A sequence that proposed ``k`` draft tokens ``d_0 .. d_{k-1}`` (drawn from
``q_0 .. q_{k-1}``) had ``k + 1`` positions scored by the target in one extend; ``p_j`` is the target's
distribution at position ``j`` after every logits processor (``Sampler.probs``, with the history
prompt + output + ``d_0 .. d_{j-1}``, so penalties, ``logit_bias`` and min-tokens apply at every
verified position exactly as they would one token at a time). Then, for ``j = 0 .. k-1``:

- random rows accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection
  the position's token is drawn from ``norm(max(0, p_j - q_j))`` and the rest is dropped;
- greedy rows accept while ``d_j`` is the argmax of ``p_j``; the first disagreement takes the argmax;
- when all ``k`` pass, a bonus token is drawn from ``p_k`` (greedy: its argmax).

Every output token is therefore distributed exactly as plain sampling from the target would give it.
A draft without probabilities (n-gram prompt lookup) is a one-hot ``q``: acceptance is ``p_j(d_j)`` and
the residual is ``p_j`` without ``d_j``. Logprobs are the target's raw ones (log-softmax of the raw
logits at each position), as for plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sample.sampler import VERIFY_STREAM, Sampler, compute_prompt_logprobs, counter_generator


@dataclass(slots=True)
class VerifiedTokens:
    """One sequence's result: ``token_ids`` are the accepted drafts then one target token (resampled at
    the first rejection, or the bonus), ``num_accepted_tokens <= num_draft_tokens``.

    ``logprobs[i]`` is the raw target logprob of ``token_ids[i]`` and ``top_logprobs[i]`` its requested
    alternatives ``(token_id, raw logprob)``; ``logprobs`` is None when the request needs none, and
    ``top_logprobs`` entries are None when it asked for no logprobs.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]] | None]
    num_draft_tokens: int
    num_accepted_tokens: int


class RejectionSampler:
    """Accepts or rejects each sequence's draft tokens against the target's distributions (stateless)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[VerifiedTokens]:
        """Verify every sequence's drafts.

        Args:
            logits: float32 ``[sum(k_i + 1), vocab_size]``, raw target logits: sequence ``i``'s ``k_i + 1``
                rows in order (the position after its last token, then after each draft); not mutated.
            metadata: one row per logits row; a sequence's rows share its params and sampling key, and row
                ``j``'s ``output_token_ids`` are the output so far plus ``d_0 .. d_{j-1}``.
            draft_token_ids: per sequence its ``k_i >= 1`` drafts.
            draft_probs: per sequence float32 ``[k_i, vocab_size]``, the distributions the drafts were
                drawn from, or None for deterministic (one-hot) drafts.

        Returns:
            one :class:`VerifiedTokens` per sequence, in order.

        Raises:
            ValueError: when the rows do not add up to ``sum(k_i + 1)``, or as ``Sampler.probs``.
        """
        num_rows = sum(len(drafts) + 1 for drafts in draft_token_ids)
        if logits.shape[0] != num_rows or len(draft_probs) != len(draft_token_ids):
            raise ValueError(f"got {logits.shape[0]} logits rows for drafts needing {num_rows}")
        probs = self.sampler.probs(logits, metadata)
        argmax: list[int] = probs.argmax(dim=-1).tolist()
        results = []
        first_row = 0
        for drafts, q in zip(draft_token_ids, draft_probs, strict=True):
            params = metadata.params[first_row]
            num_drafts = len(drafts)
            if params.is_greedy:
                num_accepted = 0
                while num_accepted < num_drafts and drafts[num_accepted] == argmax[first_row + num_accepted]:
                    num_accepted += 1
                token_ids = drafts[:num_accepted] + [argmax[first_row + num_accepted]]
            else:
                # The draws of this verification are keyed by the line and the output position it starts at.
                generator = counter_generator(
                    metadata.sampling_keys[first_row],
                    len(metadata.output_token_ids[first_row]),
                    VERIFY_STREAM,
                    logits.device,
                )
                token_ids = _verify_random(probs[first_row : first_row + num_drafts + 1], drafts, q, generator)
                num_accepted = len(token_ids) - 1
            rows = logits[first_row : first_row + len(token_ids)]
            logprobs: list[float] | None = None
            top: list[list[tuple[int, float]] | None] = [None] * len(token_ids)
            if params.needs_sampled_logprobs:
                entries = compute_prompt_logprobs(rows, token_ids, params.logprobs or 0)
                logprobs = [logprob for logprob, _ in entries]
                if params.logprobs is not None:
                    top = [alternatives for _, alternatives in entries]
            results.append(VerifiedTokens(token_ids, logprobs, top, num_drafts, num_accepted))
            first_row += num_drafts + 1
        return results


def _verify_random(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Leviathan et al.'s acceptance loop for one sequence: ``p: [k + 1, vocab]`` target distributions,
    ``q: [k, vocab]`` draft distributions (None: one-hot at the drafts). Returns accepted drafts + one token.

    Uses ``k`` uniforms and one categorical draw from ``generator``.
    """
    num_drafts = len(drafts)
    device = p.device
    draft_idx = torch.tensor(drafts, dtype=torch.long, device=device)
    positions = torch.arange(num_drafts, device=device)
    p_draft = p[positions, draft_idx]
    q_draft = torch.ones_like(p_draft) if q is None else q[positions, draft_idx]
    uniform = torch.rand(num_drafts, generator=generator, device=device)
    # accept d_j with probability min(1, p / q): u < p / q, i.e. u * q < p (q > 0: d_j was drawn from q)
    rejected = (uniform * q_draft >= p_draft).tolist()
    num_accepted = rejected.index(True) if True in rejected else num_drafts
    if num_accepted == num_drafts:
        weights = p[num_drafts]
    else:
        target = p[num_accepted]
        if q is None:
            weights = target.clone()
            weights[drafts[num_accepted]] = 0.0
        else:
            weights = (target - q[num_accepted]).clamp_(min=0.0)
        if not bool((weights > 0).any()):  # p == q: rejection had probability 0, keep the math total
            weights = target
    token = int(torch.multinomial(weights, 1, generator=generator).item())
    return drafts[:num_accepted] + [token]
