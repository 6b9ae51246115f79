"""EAGLE proposer: the EAGLE head drafts a chain of ``k`` tokens from the target's features (Li et al. 2024).

**Features.** The model runner hands every step's final-norm hidden states to :meth:`EagleProposer.observe`
(:attr:`ModelRunner.hidden_states_sink`); each sequence keeps the features of its positions ``first ..`` in one
buffer. Rows written at position ``p`` replace everything from ``p`` on (verification wrote features of drafts
that may have been rejected; a preempted sequence's recompute writes from its first uncached position), and a
write past the buffer's end starts a new buffer there (a prefix-cache hit computes no features for the cached
prompt): the head then attends over the positions it has, which may lower acceptance but never changes output.

**The head's cache.** Entry ``p`` of a sequence's head K/V reads ``(f[p], x[p + 1])``. Before drafting, the
entries of the committed positions not yet in the head's cache are computed in one call (usually the token the
target added plus the accepted drafts), ending at ``p = n - 2`` for a sequence of ``n`` tokens, whose output is
the predicted feature at ``n - 1`` and so the first draft (token ``n``). Each further draft feeds the predicted
feature with the embedding of the token drawn from it; those entries are dropped after the proposal. The head
runs per sequence (its cache is a dense tensor per sequence); the LM head and the draws are batched per step.

Drafts of greedy lines are the argmax, sampled lines draw from the head's processed distribution ``q``
(:class:`~worker.engine.spec_decode.draft_sampling.DraftDrawer`), returned in ``DraftProposal.probs``.

**Trees** (``tree_width`` ``w > 1``, greedy lines): EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2"). The root's
top-``w`` tokens are the first layer; at each further depth the ``w`` nodes of the last layer with the highest
cumulative draft log-probability are expanded in one head call (each row attends the committed entries and its
own ancestors' draft entries), each into its top-``w`` tokens; after ``k`` layers the ``w * k`` best-scored
nodes are proposed (:mod:`.head_trees`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.core.request import Sequence
from worker.engine.executor.layers.attention.tree import MAX_TREE_QUERY_LEN
from worker.engine.spec_decode.draft_sampling import DraftDrawer, chain_proposal
from worker.engine.spec_decode.head_trees import DraftLMHead, best_nodes, reindex
from worker.engine.spec_decode.heads.eagle import EagleHead
from worker.engine.spec_decode.proposer import DraftProposal, Proposer

MAX_TREE_NODES = MAX_TREE_QUERY_LEN - 1


@dataclass(slots=True)
class _EagleSeq:
    """Features of positions ``first .. first + num_features - 1`` (rows of ``features``) and the head's K/V of
    its entries ``first .. first + num_head_entries - 1``."""

    first: int
    features: torch.Tensor
    num_features: int = 0
    head_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    num_head_entries: int = 0


class EagleProposer(Proposer):
    """Drafts with an :class:`EagleHead` over ``target``'s embedding and LM head.

    Args:
        head: the trained head (eval mode, the target's dtype and device).
        target: the target model (``model.embed_tokens``, ``compute_logits``).
        eos_token_id: masked under ``min_tokens`` as for the target.
        draft_vocab: token ids the head drafts over (:class:`DraftLMHead`), None: all.
        tree_width: ``w``, a greedy line's tree width (1: chains).
    """

    method = "eagle"

    def __init__(
        self,
        head: EagleHead,
        target: Any,
        eos_token_id: int | None,
        draft_vocab: torch.Tensor | None = None,
        tree_width: int = 1,
    ) -> None:
        self.head = head
        self.target = target
        self.drawer = DraftDrawer(eos_token_id)
        self.lm = DraftLMHead(target, draft_vocab)
        self.tree_width = tree_width
        head_params = sum(p.numel() for p in head.parameters())
        lm_head_params = self.lm.num_rows * int(target.config.hidden_size)
        self.cost_per_token = (head_params + lm_head_params) / sum(p.numel() for p in target.parameters())
        self._seqs: dict[int, _EagleSeq] = {}

    def observe(
        self, seqs: list[Sequence], num_computed: list[int], num_scheduled: list[int], hidden_states: torch.Tensor
    ) -> None:
        """Keep the features the step computed (the model runner's ``hidden_states_sink``)."""
        offset = 0
        for seq, start, count in zip(seqs, num_computed, num_scheduled, strict=True):
            rows = hidden_states[offset : offset + count]
            offset += count
            state = self._seqs.get(seq.seq_id)
            if state is None or not state.first <= start <= state.first + state.num_features:
                capacity = max(2 * count, 64)
                state = self._seqs[seq.seq_id] = _EagleSeq(start, rows.new_empty(capacity, rows.shape[1]))
            end = start - state.first + count
            if end > state.features.shape[0]:
                grown = rows.new_empty(max(2 * state.features.shape[0], end), rows.shape[1])
                grown[: start - state.first] = state.features[: start - state.first]
                state.features = grown
            state.features[start - state.first : end] = rows
            state.num_features = end
            self._truncate_head(state, start - state.first)

    @staticmethod
    def _truncate_head(state: _EagleSeq, num_entries: int) -> None:
        if state.num_head_entries > num_entries:
            state.num_head_entries = num_entries
            if state.head_kv is not None:
                state.head_kv = (state.head_kv[0][:, :num_entries], state.head_kv[1][:, :num_entries])

    def free(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._seqs.pop(seq.seq_id, None)
            self.drawer.free(seq.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in seqs]
        active: list[int] = []
        features: list[torch.Tensor] = []
        pasts: list[tuple[torch.Tensor, torch.Tensor]] = []
        embed = self.target.model.embed_tokens
        for i, seq in enumerate(seqs):
            state = self._seqs.get(seq.seq_id)
            last = seq.num_tokens - 2  # the last computed position
            if state is None or not state.first <= last < state.first + state.num_features:
                continue  # no feature of the last computed position (a branch forked from another)
            state.num_features = last + 1 - state.first  # drop the features of rejected drafts
            # At least the last entry is computed: its output is the first draft's feature.
            self._truncate_head(state, min(state.num_head_entries, state.num_features - 1))
            begin = state.first + state.num_head_entries
            positions = torch.arange(begin, last + 1, device=state.features.device)
            tokens = torch.tensor(seq.token_ids[begin + 1 : last + 2], dtype=torch.long, device=positions.device)
            out, state.head_kv = self.head(
                state.features[begin - state.first : state.num_features], embed(tokens), positions, state.head_kv
            )
            state.num_head_entries = state.num_features
            active.append(i)
            features.append(out[-1:])
            pasts.append(state.head_kv)
        if not active:
            return proposals
        chains = []
        for n, i in enumerate(active):
            if self.tree_width > 1 and seqs[i].params.is_greedy:
                token_ids, parents = self._tree(seqs[i], features[n], pasts[n], num_spec_tokens[i])
                proposals[i] = DraftProposal(token_ids, None, parents)
            else:
                chains.append(n)
        if not chains:
            return proposals
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        step = chains
        for j in range(max(num_spec_tokens[active[n]] for n in chains)):
            step = [n for n in step if num_spec_tokens[active[n]] > j]
            logits = self.lm.logits(torch.cat([features[n] for n in step]))
            drawn, q = self.drawer.draw([seqs[active[n]] for n in step], logits, [drafts[n] for n in step])
            for row, n in enumerate(step):
                drafts[n].append(drawn[row])
                probs[n].append(q[row])
                if num_spec_tokens[active[n]] > j + 1:
                    position = seqs[active[n]].num_tokens - 1 + j
                    token = torch.tensor([drawn[row]], dtype=torch.long, device=logits.device)
                    features[n], pasts[n] = self.head(
                        features[n], embed(token), torch.tensor([position], device=logits.device), pasts[n]
                    )
        for n in chains:
            proposals[active[n]] = chain_proposal(seqs[active[n]], drafts[n], probs[n])
        return proposals

    def _tree(
        self, seq: Sequence, root: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor], depth: int
    ) -> tuple[list[int], list[int]]:
        """EAGLE-2's dynamic tree of ``depth`` layers from the feature ``root`` ``[1, hidden]`` predicting token
        ``seq.num_tokens`` (module docstring): ``(token_ids, parent_idx)``."""
        width = self.tree_width
        embed = self.target.model.embed_tokens
        values, ids = self.lm.top_k(root, width)
        tokens, parents, scores = ids[0].tolist(), [-1] * width, values[0].tolist()
        # The feature each candidate was predicted from, and the draft entry of each expanded candidate.
        sources = [root[0]] * width
        entries: dict[int, int] = {}
        num_committed = past[0].shape[1]
        layer = list(range(width))
        for d in range(1, depth):
            chosen = sorted(layer, key=lambda c: (-scores[c], c))[:width]
            visible = torch.zeros(len(chosen), num_committed + len(entries) + len(chosen), dtype=torch.bool)
            visible[:, :num_committed] = True
            for row, c in enumerate(chosen):
                ancestor = parents[c]
                while ancestor >= 0:
                    visible[row, num_committed + entries[ancestor]] = True
                    ancestor = parents[ancestor]
                visible[row, num_committed + len(entries) + row] = True
            for c in chosen:
                entries[c] = len(entries)
            position = torch.full((len(chosen),), seq.num_tokens - 2 + d, device=root.device)
            token = torch.tensor([tokens[c] for c in chosen], dtype=torch.long, device=root.device)
            out, past = self.head(
                torch.stack([sources[c] for c in chosen]), embed(token), position, past, visible.to(root.device)
            )
            values, ids = self.lm.top_k(out, width)
            layer = []
            for row, c in enumerate(chosen):
                for value, token_id in zip(values[row].tolist(), ids[row].tolist(), strict=True):
                    layer.append(len(tokens))
                    tokens.append(token_id)
                    parents.append(c)
                    scores.append(scores[c] + value)
                    sources.append(out[row])
        kept = best_nodes(scores, parents, min(width * depth, MAX_TREE_NODES))
        return reindex(kept, tokens, parents)
