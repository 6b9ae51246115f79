"""When to speculate and how many tokens: the automatic policy (docs/engine.md, "Speculative decoding").

A verification step pays for itself when the batch is small: a decode step then reads every weight for
one token per sequence, so checking ``k`` more positions costs little next to the ``k`` tokens that may
be accepted. The policy therefore:

1. speculates only while the running batch has at most ``disable_by_batch_size`` sequences (vLLM V0's
   ``speculative_disable_by_batch_size``), unless the deployment forces it on;
2. measures each sequence's acceptance and picks ``k`` to maximise expected tokens per unit of cost.
   Under Leviathan et al.'s model (each draft accepted with probability ``alpha``, independently), a
   step with ``k`` drafts yields ``(1 - alpha ** (k + 1)) / (1 - alpha)`` tokens and costs
   ``1 + k * (verify_cost_per_token + proposer cost_per_token)`` decode steps; ``k = 0`` (plain decode)
   yields 1 for 1. ``alpha`` is estimated from decayed counts of accepted and rejected drafts (a
   rejection ends a run), ``(accepted + 1) / (accepted + rejected + 2)``; the counts decay at every
   decision, so a sequence whose drafts stopped paying is re-tried once its old rejections fade.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past per decision: about the last five draft steps count
# NOTE: an estimate for CPU at small batches (docs/engine.md, "Speculative decoding"), not measured per machine: one more
# verified position costs about this fraction of a decode step.
VERIFY_COST_PER_TOKEN = 0.1


@dataclass(slots=True)
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with ``k`` drafts yields when each is accepted with probability ``alpha``:
    ``1 + alpha + ... + alpha ** k`` (Leviathan et al. 2023, equation 1)."""
    return sum(alpha**j for j in range(k + 1))


class SpecDecodePolicy:
    """Decides each sequence's number of draft tokens per step.

    Args:
        force: speculate at any batch size and never drop to ``k = 0`` (the deployment forced it on).
        max_spec_tokens: the most drafts per step (``num_speculative_tokens``).
        disable_by_batch_size: no speculation while more sequences run (ignored when forced).
        cost_per_token: cost of one draft token (verification plus proposal) relative to a decode step.

    Raises:
        ValueError: on a non-positive ``max_spec_tokens`` or ``disable_by_batch_size``, or a negative cost.
    """

    def __init__(self, *, force: bool, max_spec_tokens: int, disable_by_batch_size: int, cost_per_token: float) -> None:
        if max_spec_tokens < 1 or disable_by_batch_size < 1 or cost_per_token < 0:
            raise ValueError("max_spec_tokens and disable_by_batch_size must be >= 1, cost_per_token >= 0")
        self.force = force
        self.max_spec_tokens = max_spec_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.cost_per_token = cost_per_token
        self._acceptance: dict[int, _Acceptance] = {}

    def batch_speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running sequences speculates at all."""
        return self.force or num_running <= self.disable_by_batch_size

    def num_spec_tokens(self, seq_id: int) -> int:
        """Drafts to propose for ``seq_id`` this step (0: decode plainly); decays its counts."""
        acceptance = self._acceptance.setdefault(seq_id, _Acceptance())
        alpha = acceptance.rate
        acceptance.accepted *= DECAY
        acceptance.rejected *= DECAY
        best_k, best_rate = 0, 1.0
        for k in range(1, self.max_spec_tokens + 1):
            rate = expected_tokens(alpha, k) / (1.0 + k * self.cost_per_token)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return max(best_k, 1) if self.force else best_k

    def record(self, seq_id: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``seq_id``: ``num_accepted_tokens`` of ``num_draft_tokens`` accepted."""
        acceptance = self._acceptance.setdefault(seq_id, _Acceptance())
        acceptance.accepted += num_accepted_tokens
        acceptance.rejected += 1.0 if num_accepted_tokens < num_draft_tokens else 0.0

    def free(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)
