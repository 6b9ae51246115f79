"""Medusa proposer: head ``k`` drafts token ``n + k`` of a sequence of ``n`` tokens, a chain (Cai et al. 2024).

The model runner hands every step's final-norm hidden states to :meth:`MedusaProposer.observe`; a sequence keeps
those of its last step. Its last computed position ``n - 2`` is always among them (the decode's row, or the
row of the last accepted draft, or a prompt's last row); the target predicted token ``n - 1`` from it, and the
heads predict tokens ``n, n + 1, ...``. All heads run at once; greedy lines draft each head's argmax (top-1),
sampled lines draw from each head's processed distribution ``q`` (returned in ``DraftProposal.probs``), so the
rejection sampler keeps the target distribution.

**Trees** (``tree_width`` ``w > 1``, greedy lines): Medusa's tree (Cai et al. 2024, section 2.1.2): the paths whose
``d``-th token is one of head ``d``'s top-``w`` tokens, pruned to the ``w * k`` likeliest by the product of the
heads' probabilities (:func:`~worker.engine.spec_decode.head_trees.product_tree`; Medusa fixes the tree's shape
offline from calibrated head accuracies, here it follows each step's own probabilities).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from worker.engine.core.request import Sequence
from worker.engine.executor.layers.attention.tree import MAX_TREE_QUERY_LEN
from worker.engine.spec_decode.draft_sampling import DraftDrawer, chain_proposal
from worker.engine.spec_decode.head_trees import DraftLMHead, product_tree
from worker.engine.spec_decode.heads.medusa import MedusaHeads
from worker.engine.spec_decode.proposer import DraftProposal, Proposer


class MedusaProposer(Proposer):
    """Drafts up to ``heads.num_heads`` tokens from :class:`MedusaHeads` over ``target``'s LM head.

    Args:
        heads: the trained heads (eval mode, the target's dtype and device).
        target: the target model (``compute_logits``, ``lm_head``).
        eos_token_id: masked under ``min_tokens`` as for the target.
        draft_vocab: token ids the heads draft over (:class:`DraftLMHead`; not with own LM heads), None: all.
        tree_width: ``w``, a greedy line's tree width (1: chains).
    """

    method = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        target: Any,
        eos_token_id: int | None,
        draft_vocab: torch.Tensor | None = None,
        tree_width: int = 1,
    ) -> None:
        self.heads = heads
        self.target = target
        self.drawer = DraftDrawer(eos_token_id)
        self.lm = DraftLMHead(target, None if heads.own_lm_heads else draft_vocab)
        self.tree_width = tree_width
        self.max_depth = heads.num_heads
        # All heads run once per proposal; each draft costs about one LM head.
        block_params = sum(p.numel() for p in heads.parameters()) / heads.num_heads
        lm_head_params = self.lm.num_rows * int(target.config.hidden_size)
        self.cost_per_token = (block_params + lm_head_params) / sum(p.numel() for p in target.parameters())
        self._last_rows: dict[int, tuple[int, torch.Tensor]] = {}

    def observe(
        self, seqs: list[Sequence], num_computed: list[int], num_scheduled: list[int], hidden_states: torch.Tensor
    ) -> None:
        """Keep each sequence's rows of this step (the model runner's ``hidden_states_sink``)."""
        offset = 0
        for seq, start, count in zip(seqs, num_computed, num_scheduled, strict=True):
            self._last_rows[seq.seq_id] = (start, hidden_states[offset : offset + count].clone())
            offset += count

    def free(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._last_rows.pop(seq.seq_id, None)
            self.drawer.free(seq.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in seqs]
        active, features = [], []
        for i, seq in enumerate(seqs):
            start, rows = self._last_rows.get(seq.seq_id, (0, None))
            last = seq.num_tokens - 2
            if rows is not None and start <= last < start + rows.shape[0]:
                active.append(i)
                features.append(rows[last - start])
        if not active:
            return proposals
        k = min(max(num_spec_tokens[i] for i in active), self.heads.num_heads)
        outputs = self.heads(torch.stack(features))[:k]  # [k, num_active, ...]
        chains = []
        for n, i in enumerate(active):
            depth = min(num_spec_tokens[i], k)
            if self.tree_width > 1 and seqs[i].params.is_greedy and not self.heads.own_lm_heads:
                values, ids = self.lm.top_k(outputs[:depth, n], self.tree_width)
                num_nodes = min(self.tree_width * depth, MAX_TREE_QUERY_LEN - 1)
                token_ids, parents = product_tree(values, ids, num_nodes)
                proposals[i] = DraftProposal(token_ids, None, parents)
            else:
                chains.append(n)
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for j in range(k):
            step = [n for n in chains if num_spec_tokens[active[n]] > j]
            if not step:
                break
            rows = outputs[j, step]
            logits = rows.float() if self.heads.own_lm_heads else self.lm.logits(rows)
            tokens, q = self.drawer.draw([seqs[active[n]] for n in step], logits, [drafts[n] for n in step])
            for row, n in enumerate(step):
                drafts[n].append(tokens[row])
                probs[n].append(q[row])
        for n in chains:
            proposals[active[n]] = chain_proposal(seqs[active[n]], drafts[n], probs[n])
        return proposals
