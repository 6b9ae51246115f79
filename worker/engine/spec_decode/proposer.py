"""The ``Proposer`` interface: who drafts the tokens a speculative step verifies.

A proposer looks at running sequences about to decode and proposes up to ``k`` tokens each, with the
distributions it drew them from (None for a deterministic draft, which the rejection sampler treats as
one-hot). The tokens form a chain, or a tree (``parent_idx``) verified in the same single pass with a tree
attention mask (docs/engine.md, "Speculative decoding"). It may keep per-sequence state (an index, a KV
cache), which :meth:`Proposer.free` drops when a sequence finishes or is preempted.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from worker.engine.core.request import Sequence


@dataclass(slots=True)
class DraftProposal:
    """Draft tokens for one sequence: ``token_ids`` (possibly empty: nothing to propose) and ``probs``,
    float32 ``[len(token_ids), vocab_size]``, the distribution each was drawn from given its parent path, or
    None (one-hot).

    ``parent_idx`` None: the tokens are a chain. Otherwise a tree of ``len(token_ids)`` nodes (at most 63):
    ``token_ids[i]`` follows ``token_ids[parent_idx[i]]``, or the sequence's last token when ``parent_idx[i]`` is
    ``-1``; parents come before children. Siblings are tried in their order, so the likeliest goes first; a
    sibling drawn from ``probs`` must have been drawn independently of its siblings (otherwise pass None:
    ``worker/engine/sample/rejection_sampler.py``). The scheduler may keep only a prefix of the nodes.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parent_idx: list[int] | None = None


class Proposer(abc.ABC):
    """Drafts tokens for speculative decoding.

    Attributes:
        cost_per_token: the proposer's own cost of one draft token, as a fraction of one target decode
            step (the policy weighs it against the acceptance rate; 0 for prompt lookup).
        tree_width: the most nodes per depth of its draft trees (1: chains), which the policy prices.
        max_depth: the deepest draft it can propose (None: as deep as asked; Medusa: its number of heads).
        method: its ``speculative_method`` name, which labels its per-method counters.
    """

    cost_per_token: float = 0.0
    tree_width: int = 1
    max_depth: int | None = None
    method: str = "other"

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        """Up to ``num_spec_tokens[i]`` (``>= 1``) draft tokens following ``seqs[i].token_ids``.

        Every sequence is about to decode: all its tokens but the last are computed in the target's cache.
        """

    def free(self, seqs: Iterable[Sequence]) -> None:  # noqa: B027 (stateless proposers keep nothing)
        """Forget any state kept for ``seqs`` (finished, aborted or preempted)."""
