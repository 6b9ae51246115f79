"""Token trees of speculative verification: the per-row visibility bits and depth-based positions.

A sequence verifying a draft tree computes one query of ``1 + num_nodes`` rows: its last token (row 0), then
the nodes in topological order (``parent_idx[i] < i``; ``-1`` is the last token). Node ``i``'s K/V go to the
slot after the last token's plus ``i`` (the sequence's next slots, as a chain's would), its rotary position is
the last token's plus its depth, and it attends the cached context, the last token and its ancestors (Miao et
al. 2023, "SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative Inference and
Verification", section 4; Cai et al. 2024, "Medusa", section 2.1.2). The kernels take the visibility as one
int64 per row (``tree_mask``, :func:`kernels.reference.paged_attention_reference`).
"""

from __future__ import annotations

# Bits of one int64 row mask: a tree verifies at most this many rows (its last token and 63 nodes).
MAX_TREE_QUERY_LEN = 64


def tree_mask_bits(parent_idx: list[int]) -> list[int]:
    """The ``1 + len(parent_idx)`` row masks of a tree's query: bit ``j`` of row ``r`` is set when row ``j`` is
    ``r`` itself or one of its ancestors (row 0, the last token, is everyone's). Values fit a signed int64.

    Raises:
        ValueError: when a parent does not precede its child, or the tree has more than 63 nodes.
    """
    if len(parent_idx) >= MAX_TREE_QUERY_LEN:
        raise ValueError(f"a draft tree has at most {MAX_TREE_QUERY_LEN - 1} nodes, got {len(parent_idx)}")
    masks = [1]
    for i, parent in enumerate(parent_idx):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}: parent {parent} must be -1 or an earlier node")
        bits = masks[parent + 1] | (1 << (i + 1))
        masks.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return masks


def tree_depths(parent_idx: list[int]) -> list[int]:
    """Depth of each node (a child of the last token has depth 1); the node's position is the last token's
    plus its depth."""
    depths: list[int] = []
    for parent in parent_idx:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_path(parent_idx: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (``-1``: the empty path), in order."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parent_idx[node]
    return path[::-1]
