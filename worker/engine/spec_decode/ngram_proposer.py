"""N-gram prompt lookup: draft by copying what followed the last ``n`` tokens earlier in the sequence.

Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``NgramProposer`` (``prompt_lookup_min`` /
``prompt_lookup_max``). No model: for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min`` the
last ``n`` tokens of prompt + output are looked up in the sequence's own earlier tokens; at the first
``n`` that matches, the tokens that followed its most recent earlier occurrence are proposed, up to
``k``. When the continuation reaches the end of the sequence it goes on copying its own proposal (the
period of a repetition), so a repeated word or line drafts a full ``k`` tokens.

With ``tree_width > 1`` the earlier occurrences whose next tokens differ become the branches of a draft tree
(``DraftProposal.parent_idx``): the latest continuation first (the chain above, the likeliest by recency),
then the latest continuation starting with each other next token, up to ``tree_width`` branches, each up to
``k`` tokens (copied up to the end of the sequence), all verified in one pass (Miao et al. 2023, "SpecInfer",
whose token trees merge several speculations; here the speculations are the context's own). Distinct first
tokens make the siblings deterministic, distinct drafts, as the tree rejection sampler requires.

Each sequence keeps an index, one dict per ``n`` from n-gram to the positions of its latest ends with
distinct next tokens (at most ``tree_width``, the latest last), updated with the tokens added since the last
proposal: a proposal costs ``O(prompt_lookup_max * tree_width)`` operations per new token, whatever the
sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from worker.engine.core.request import Sequence
from worker.engine.executor.layers.attention.tree import MAX_TREE_QUERY_LEN
from worker.engine.spec_decode.proposer import DraftProposal, Proposer


@dataclass(slots=True)
class _NgramIndex:
    """``ends[n - 1][ngram]``: the latest positions where ``ngram`` (``n`` tokens) ends, one per distinct next
    token, oldest first (at most ``tree_width``), among the ends ``0 .. num_indexed - 1``."""

    ends: list[dict[tuple[int, ...], list[int]]]
    num_indexed: int = 0
    token_ids: list[int] = field(default_factory=list)


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own prompt and output (no model, one-hot drafts).

    Args:
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first.
        tree_width: the most branches of a proposed tree (1: chains only).

    Raises:
        ValueError: unless ``1 <= prompt_lookup_min <= prompt_lookup_max`` and ``tree_width >= 1``.
    """

    method = "ngram"

    cost_per_token = 0.0

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 8, tree_width: int = 1) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.tree_width = tree_width
        self._indexes: dict[int, _NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        proposals = []
        for seq, k in zip(seqs, num_spec_tokens, strict=True):
            branches = self.propose_branches(seq.seq_id, seq.token_ids, k)
            token_ids = [token for branch in branches for token in branch]
            parent_idx: list[int] | None = None
            if len(branches) > 1:
                parent_idx = []
                for branch in branches:
                    first = len(parent_idx)
                    parent_idx.extend([-1] + list(range(first, first + len(branch) - 1)))
            proposals.append(DraftProposal(token_ids, parent_idx=parent_idx))
        return proposals

    def propose_tokens(self, key: int, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``token_ids`` by lookup, from its latest match (``key`` names the index
        kept for it; the list may only have grown since the last call with that key)."""
        branches = self.propose_branches(key, token_ids, k)
        return branches[0] if branches else []

    def propose_branches(self, key: int, token_ids: list[int], k: int) -> list[list[int]]:
        """The continuations of the longest matching n-gram's latest earlier ends with distinct next tokens,
        latest first, at most ``tree_width`` of them and ``MAX_TREE_QUERY_LEN - 1`` tokens in all: the first up
        to ``k`` tokens (copying its own proposal past the sequence's end), the others up to ``k`` tokens
        before the end. Empty when nothing matches."""
        index = self._indexes.get(key)
        if index is None or index.token_ids is not token_ids:
            index = self._indexes[key] = _NgramIndex([{} for _ in range(self.prompt_lookup_max)], 0, token_ids)
        num_tokens = len(token_ids)
        width = self.tree_width
        # Index every n-gram that ends before the last token (the suffix itself must match an earlier one).
        for end in range(index.num_indexed, num_tokens - 1):
            next_token = token_ids[end + 1]
            for n in range(1, min(self.prompt_lookup_max, end + 1) + 1):
                ends = index.ends[n - 1].setdefault(tuple(token_ids[end - n + 1 : end + 1]), [])
                if width == 1:
                    ends[:] = [end]
                    continue
                for i, other in enumerate(ends):
                    if token_ids[other + 1] == next_token:
                        del ends[i]
                        break
                ends.append(end)
                if len(ends) > width:
                    del ends[0]
        index.num_indexed = max(index.num_indexed, num_tokens - 1)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            match_ends = index.ends[n - 1].get(tuple(token_ids[num_tokens - n :]))
            if not match_ends:
                continue
            match_end = match_ends[-1]
            draft: list[int] = []
            for j in range(k):
                source = match_end + 1 + j
                draft.append(token_ids[source] if source < num_tokens else draft[source - num_tokens])
            branches = [draft]
            room = MAX_TREE_QUERY_LEN - 1 - len(draft)
            for other in reversed(match_ends[:-1]):
                branch = token_ids[other + 1 : min(other + 1 + k, num_tokens, other + 1 + room)]
                if not branch:
                    break
                branches.append(branch)
                room -= len(branch)
            return branches
        return []

    def free(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._indexes.pop(seq.seq_id, None)
