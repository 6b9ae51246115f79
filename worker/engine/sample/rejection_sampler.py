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

**Trees.** Drafts may form a tree (``parent_idx``, ``worker/engine/executor/layers/attention/tree.py``): row 0
is the target's distribution after the last token, row ``i + 1`` the one after node ``i`` (its history is the
output plus the tokens on the path to node ``i``). Greedy rows walk down from the root, taking at each node the
child whose token is the argmax, and end with the argmax where no child has it. Random rows use SpecInfer's
multi-step speculative sampling (Miao et al. 2023, algorithm 2; EAGLE's tree sampling, Li et al. 2024): at a
node with target distribution ``r = p``, the children are tried in order; child ``c`` (drawn from ``q_c``) is
accepted with probability ``min(1, r(x_c) / q_c(x_c))``; on rejection ``r`` becomes ``norm(max(0, r - q_c))``
(a one-hot ``q_c``: ``r`` without ``x_c``, renormalised) and the next child is tried; when every child is
rejected the token is drawn from ``r``; an accepted leaf adds a bonus token from its row. Each step's token is
then distributed as ``p`` at that node, whatever the children, provided each child was drawn independently
from its ``q_c`` given the path (siblings chosen without replacement, such as distinct n-gram continuations
or a top-k, must be deterministic drafts: ``probs`` None). A chain is the tree whose node ``i`` has parent
``i - 1``, and both rules then reduce to the ones above.
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
    ``top_logprobs`` entries are None when it asked for no logprobs. ``accepted_nodes`` are the draft indices
    of the accepted tokens, root to leaf (``0 .. num_accepted_tokens - 1`` for a chain; for a tree, where their
    K/V were written).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]] | None]
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_nodes: list[int]


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
        draft_parents: list[list[int] | None] | None = None,
    ) -> list[VerifiedTokens]:
        """Verify every sequence's drafts.

        Args:
            logits: float32 ``[sum(k_i + 1), vocab_size]``, raw target logits: sequence ``i``'s ``k_i + 1``
                rows in order (the position after its last token, then after each draft); not mutated.
            metadata: one row per logits row; a sequence's rows share its params and sampling key, and row
                ``j``'s ``output_token_ids`` are the output so far plus the drafts on the path to draft
                ``j - 1`` (a chain: ``d_0 .. d_{j-1}``).
            draft_token_ids: per sequence its ``k_i >= 1`` drafts.
            draft_probs: per sequence float32 ``[k_i, vocab_size]``, the distributions the drafts were
                drawn from, or None for deterministic (one-hot) drafts.
            draft_parents: per sequence None (a chain) or its tree's ``parent_idx`` (``k_i`` entries, ``-1``
                for a child of the last token, parents before children); None: all chains.

        Returns:
            one :class:`VerifiedTokens` per sequence, in order.

        Raises:
            ValueError: when the rows do not add up to ``sum(k_i + 1)``, a tree's parents do not match its
                drafts, or as ``Sampler.probs``.
        """
        num_rows = sum(len(drafts) + 1 for drafts in draft_token_ids)
        if logits.shape[0] != num_rows or len(draft_probs) != len(draft_token_ids):
            raise ValueError(f"got {logits.shape[0]} logits rows for drafts needing {num_rows}")
        parents_of = draft_parents if draft_parents is not None else [None] * len(draft_token_ids)
        probs = self.sampler.probs(logits, metadata)
        argmax: list[int] = probs.argmax(dim=-1).tolist()
        results = []
        first_row = 0
        for drafts, q, parents in zip(draft_token_ids, draft_probs, parents_of, strict=True):
            params = metadata.params[first_row]
            num_drafts = len(drafts)
            if parents is not None and len(parents) != num_drafts:
                raise ValueError(f"a tree of {num_drafts} drafts has {len(parents)} parents")
            if parents is None and params.is_greedy:
                num_accepted = 0
                while num_accepted < num_drafts and drafts[num_accepted] == argmax[first_row + num_accepted]:
                    num_accepted += 1
                accepted = list(range(num_accepted))
                token_ids = drafts[:num_accepted] + [argmax[first_row + num_accepted]]
            elif parents is not None and params.is_greedy:
                accepted = _walk_greedy(argmax[first_row : first_row + num_drafts + 1], drafts, parents)
                token_ids = [drafts[node] for node in accepted] + [argmax[first_row + 1 + (accepted or [-1])[-1]]]
            else:
                # The draws of this verification are keyed by the line and the output position it starts at.
                generator = counter_generator(
                    metadata.sampling_keys[first_row],
                    len(metadata.output_token_ids[first_row]),
                    VERIFY_STREAM,
                    logits.device,
                )
                seq_probs = probs[first_row : first_row + num_drafts + 1]
                if parents is None:
                    token_ids = _verify_random(seq_probs, drafts, q, generator)
                    accepted = list(range(len(token_ids) - 1))
                else:
                    accepted, token = _verify_tree_random(seq_probs, drafts, parents, q, generator)
                    token_ids = [drafts[node] for node in accepted] + [token]
            num_accepted = len(accepted)
            # Token i was scored by its parent's row: row 0 for the first, then each accepted node's row.
            if parents is None:
                rows = logits[first_row : first_row + len(token_ids)]
            else:
                row_idx = [first_row] + [first_row + 1 + node for node in accepted]
                rows = logits[torch.tensor(row_idx, dtype=torch.long, device=logits.device)]
            logprobs: list[float] | None = None
            top: list[list[tuple[int, float]] | None] = [None] * len(token_ids)
            if params.needs_sampled_logprobs:
                entries = compute_prompt_logprobs(rows, token_ids, params.logprobs or 0)
                logprobs = [logprob for logprob, _ in entries]
                if params.logprobs is not None:
                    top = [alternatives for _, alternatives in entries]
            results.append(VerifiedTokens(token_ids, logprobs, top, num_drafts, num_accepted, accepted))
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


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Children of each node in order (key ``-1``: the last token's)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"draft {node}: parent {parent} must be -1 or an earlier draft")
        children.setdefault(parent, []).append(node)
    return children


def _residual_after_rejection(residual: torch.Tensor, token: int, q_child: torch.Tensor | None) -> torch.Tensor:
    """``max(0, r - q_c)`` after child token ``token`` (drawn from ``q_c``, None: one-hot) was rejected, not
    normalised; ``residual`` is not mutated."""
    if q_child is None:
        residual = residual.clone()
        residual[token] = 0.0
        return residual
    return (residual - q_child).clamp_(min=0.0)


def _walk_greedy(argmax: list[int], drafts: list[int], parents: list[int]) -> list[int]:
    """The accepted path of a greedy tree: from the root, the child whose token is the argmax of its parent's
    row (``argmax[node + 1]``, ``argmax[0]`` for the root), while there is one."""
    children = _children(parents)
    path: list[int] = []
    node = -1
    while True:
        target = argmax[node + 1]
        node = next((child for child in children.get(node, ()) if drafts[child] == target), -2)
        if node == -2:
            return path
        path.append(node)


def _verify_tree_random(
    p: torch.Tensor, drafts: list[int], parents: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> tuple[list[int], int]:
    """SpecInfer's multi-step speculative sampling down one tree: ``p: [n + 1, vocab]`` target distributions
    (row ``i + 1`` after node ``i``), ``q: [n, vocab]`` the distribution each node was drawn from (None:
    one-hot). Returns the accepted nodes, root to leaf, and the final token (the residual's draw, or the
    bonus at an accepted leaf).

    Uses one uniform per child tried and one categorical draw from ``generator``.
    """
    children = _children(parents)
    path: list[int] = []
    node = -1
    while True:
        residual = p[node + 1]
        accepted = None
        for child in children.get(node, ()):
            token = drafts[child]
            q_token = 1.0 if q is None else float(q[child, token])
            uniform = float(torch.rand(1, generator=generator, device=p.device))
            # accept with probability min(1, r / q): u * q < r (q > 0: the child was drawn from q)
            if uniform * q_token < float(residual[token]):
                accepted = child
                break
            residual = _residual_after_rejection(residual, token, None if q is None else q[child])
            total = residual.sum()
            # r == q: this rejection had probability 0, keep the math total
            residual = residual / total if bool(total > 0) else p[node + 1]
        if accepted is None:
            return path, int(torch.multinomial(residual, 1, generator=generator).item())
        path.append(accepted)
        node = accepted
