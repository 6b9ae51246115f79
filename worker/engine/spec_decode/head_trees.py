"""What the head proposers share: the draft LM head (optionally over a vocabulary subset) and draft trees.

**Draft vocabulary** (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary): the LM head is most of a head's
drafting cost (SmolLM2-135M: 49,152 x 576 weights, a fifth of the model), so a head may draft over the
``draft_vocab`` most frequent tokens of its training text only (``heads/storage.py``). Logits outside the subset
are ``-inf``: a draft is then never such a token, the draft distribution ``q`` has no mass there, and the
verification, which uses the target's full vocabulary, keeps outputs and distributions exact.

**Trees** (greedy lines; a sampled line keeps its drawn chain): nodes are top-``width`` tokens, deterministic like
n-gram branches, so the rejection sampler treats them as one-hot and greedy output is plain decoding's whatever
the tree. A node's score is the sum of its path's draft log-probabilities; the ``num_nodes`` best-scored nodes
are kept, which always includes a kept node's parent (a child's score is at most its parent's) and puts parents
first (EAGLE-2's re-ranking, Li et al. 2024, "EAGLE-2", section 4.2).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch


class DraftLMHead:
    """The target's LM head for drafting, over all tokens or ``vocab_ids`` only.

    Args:
        target: the target model (``compute_logits``; for a subset, ``config.tie_word_embeddings`` and
            ``model.embed_tokens.weight``, or a plain ``lm_head.weight``).
        vocab_ids: LongTensor ``[n]`` of token ids to draft over, or None (all). Ignored (all tokens) when the
            target's LM head weights are not a plain ``[vocab_size, hidden_size]`` matrix (a packed one).
    """

    def __init__(self, target: Any, vocab_ids: torch.Tensor | None) -> None:
        self.target = target
        self.vocab_size = int(target.config.vocab_size)
        self.vocab_ids: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        weight = _plain_lm_head_weight(target)
        if vocab_ids is not None and weight is not None:
            self.vocab_ids = vocab_ids.to(weight.device)
            self.weight = weight[self.vocab_ids].contiguous()

    @property
    def num_rows(self) -> int:
        """Rows of the projection (its cost relative to the full LM head is ``num_rows / vocab_size``)."""
        return self.vocab_size if self.vocab_ids is None else int(self.vocab_ids.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[m, hidden_size]`` -> float32 logits ``[m, vocab_size]`` (``-inf`` outside the subset)."""
        if self.weight is None or self.vocab_ids is None:
            logits: torch.Tensor = self.target.compute_logits(features)
            return logits
        full = torch.full((features.shape[0], self.vocab_size), float("-inf"), device=features.device)
        full[:, self.vocab_ids] = (features @ self.weight.T).float()
        return full

    def top_k(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` likeliest tokens of each row: float32 log-probabilities and LongTensor ids, ``[m, k]`` each,
        best first."""
        if self.weight is None or self.vocab_ids is None:
            logprobs = torch.log_softmax(self.target.compute_logits(features), dim=-1)
            values, ids = logprobs.topk(k, dim=-1)
            return values, ids
        logprobs = torch.log_softmax((features @ self.weight.T).float(), dim=-1)
        values, index = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        return values, self.vocab_ids[index]


def _plain_lm_head_weight(target: Any) -> torch.Tensor | None:
    config = target.config
    if bool(getattr(config, "tie_word_embeddings", False)):
        embed: torch.Tensor = target.model.embed_tokens.weight
        return embed
    weight = getattr(getattr(target, "lm_head", None), "weight", None)
    shape = (int(config.vocab_size), int(config.hidden_size))
    return weight if isinstance(weight, torch.Tensor) and tuple(weight.shape) == shape else None


def best_nodes(scores: list[float], parents: list[int], num_nodes: int) -> list[int]:
    """The ``num_nodes`` best-scored nodes of a candidate tree (``parents[i] < i``, ``-1``: the root), in their
    original (topological) order. Ties keep the earlier node, so a kept node's parent is kept too whenever
    scores do not rise along a path."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:num_nodes]
    return sorted(order)


def reindex(kept: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """``kept`` candidate nodes (topological, parent-closed) as a proposal's ``token_ids`` and ``parent_idx``."""
    new_index = {old: new for new, old in enumerate(kept)}
    return [tokens[i] for i in kept], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]


def product_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, num_nodes: int) -> tuple[list[int], list[int]]:
    """Medusa's tree: paths whose token at depth ``d`` is one of head ``d``'s top-``width`` tokens (the cartesian
    product of the heads' top tokens), pruned to the ``num_nodes`` likeliest by the product of the heads'
    probabilities, found best first.

    Args:
        logprobs: float32 ``[num_heads, width]`` each head's top log-probabilities, best first.
        token_ids: LongTensor ``[num_heads, width]`` their tokens.
        num_nodes: nodes to keep (``>= 1``).

    Returns:
        ``(token_ids, parent_idx)`` of the tree, parents first, siblings likeliest first.
    """
    values, ids = logprobs.tolist(), token_ids.tolist()
    num_heads = len(values)
    tokens: list[int] = []
    parents: list[int] = []
    # (negated score, tie order, depth, choice index, parent node)
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0
    for c, value in enumerate(values[0]):
        heap.append((-value, counter, 0, c, -1))
        counter += 1
    heapq.heapify(heap)
    while heap and len(tokens) < num_nodes:
        negated, _, depth, choice, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth][choice])
        parents.append(parent)
        if depth + 1 < num_heads:
            for c, value in enumerate(values[depth + 1]):
                heapq.heappush(heap, (negated - value, counter, depth + 1, c, node))
                counter += 1
    return tokens, parents
