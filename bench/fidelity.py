"""Count the lines whose greedy ids differ between batchinfer and a reference, under the near-tie rule.

The rule is the parity tests' (tests/helpers/parity.py, docs/engine.md "Correctness testing"): ids must be
equal, or the first divergence must sit where the reference's top two logprobs are within 1e-4 of each other
and our token is one of those two.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.parity import assert_greedy_close


def differing_lines(
    ours: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    reference_top2: Sequence[Sequence[Sequence[float]]],
) -> int:
    """Lines where ``ours[i]`` breaks the near-tie rule against ``reference[i]`` with its per-position top two
    ``(logprob_1, logprob_2, token_id_1, token_id_2)``."""
    count = 0
    for i, (test_ids, ref_ids, top2) in enumerate(zip(ours, reference, reference_top2, strict=True)):
        try:
            assert_greedy_close(ref_ids, [tuple(t) for t in top2], test_ids, label=f"line {i}")
        except AssertionError as exc:
            print(exc, file=sys.stderr)
            count += 1
    return count
