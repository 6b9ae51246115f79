"""N-gram prompt lookup: draft by copying what followed the last ``n`` tokens earlier in the sequence.

Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``NgramProposer`` (``prompt_lookup_min`` /
``prompt_lookup_max``). No model: for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min`` the
last ``n`` tokens of prompt + output are looked up in the sequence's own earlier tokens; at the first
``n`` that matches, the tokens that followed its most recent earlier occurrence are proposed, up to
``k``. When the continuation reaches the end of the sequence it goes on copying its own proposal (the
period of a repetition), so a repeated word or line drafts a full ``k`` tokens.

Each sequence keeps an index, one dict per ``n`` from n-gram to the position of its latest end, updated
with the tokens added since the last proposal: a proposal costs ``O(prompt_lookup_max)`` dict operations
per new token, whatever the sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from worker.engine.core.request import Sequence
from worker.engine.spec_decode.proposer import DraftProposal, Proposer


@dataclass(slots=True)
class _NgramIndex:
    """``last_end[n - 1][ngram]``: the latest position where ``ngram`` (``n`` tokens) ends, among the ends
    ``0 .. num_indexed - 1``."""

    last_end: list[dict[tuple[int, ...], int]]
    num_indexed: int = 0
    token_ids: list[int] = field(default_factory=list)


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own prompt and output (no model, one-hot drafts).

    Raises:
        ValueError: unless ``1 <= prompt_lookup_min <= prompt_lookup_max``.
    """

    cost_per_token = 0.0

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 8) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[int, _NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        return [
            DraftProposal(self.propose_tokens(seq.seq_id, seq.token_ids, k))
            for seq, k in zip(seqs, num_spec_tokens, strict=True)
        ]

    def propose_tokens(self, key: int, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``token_ids`` by lookup (``key`` names the index kept for it; the
        list may only have grown since the last call with that key)."""
        index = self._indexes.get(key)
        if index is None or index.token_ids is not token_ids:
            index = self._indexes[key] = _NgramIndex([{} for _ in range(self.prompt_lookup_max)], 0, token_ids)
        num_tokens = len(token_ids)
        # Index every n-gram that ends before the last token (the suffix itself must match an earlier one).
        for end in range(index.num_indexed, num_tokens - 1):
            for n in range(1, min(self.prompt_lookup_max, end + 1) + 1):
                index.last_end[n - 1][tuple(token_ids[end - n + 1 : end + 1])] = end
        index.num_indexed = max(index.num_indexed, num_tokens - 1)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            match_end = index.last_end[n - 1].get(tuple(token_ids[num_tokens - n :]))
            if match_end is None:
                continue
            draft: list[int] = []
            for j in range(k):
                source = match_end + 1 + j
                draft.append(token_ids[source] if source < num_tokens else draft[source - num_tokens])
            return draft
        return []

    def free(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._indexes.pop(seq.seq_id, None)
