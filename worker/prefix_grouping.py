"""Shared-prefix grouping: an admission order for a job's lines in which lines sharing a prefix are adjacent.

docs/engine.md, "Prefix caching": the worker admits a job's lines in this order, so the first line of a group
pays the prefill of the shared prefix and its siblings, admitted right after it, hit the prefix cache
(the scheduler holds a sibling back until the shared blocks are computed). Sorting the prompts
lexicographically by token ids puts every set of prompts with a common prefix in one contiguous run
(nested: longer shared prefixes form runs inside shorter ones), which is what a trie walk would give.
"""

from __future__ import annotations

import sys
from array import array


def _sort_key(token_ids: list[int]) -> bytes:
    """Token ids as fixed-width big-endian bytes: bytes order = token-id lexicographic order, compared by memcmp."""
    packed = array("I", token_ids)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def order_by_shared_prefix(prompt_token_ids: list[list[int]]) -> list[int]:
    """Admission order of ``prompt_token_ids`` (indices into it) grouping lines that share a prefix.

    Lexicographic order of the token id lists; equal prompts keep their input order (stable sort).
    O(total tokens + n log n comparisons), each comparison one ``memcmp`` over the packed ids.

    Raises:
        OverflowError: a token id outside ``[0, 2**32)``.
    """
    keys = [_sort_key(ids) for ids in prompt_token_ids]
    return sorted(range(len(keys)), key=keys.__getitem__)
