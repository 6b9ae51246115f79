"""When to speculate and how many tokens: the automatic policy (docs/engine.md, "Speculative decoding").

A verification step pays for itself when the batch is small: a decode step then reads every weight for
few tokens, so checking ``k`` more positions costs little next to the ``k`` tokens that may be accepted.
The policy therefore:

1. speculates only while the running batch has at most ``disable_by_batch_size`` sequences (vLLM V0's
   ``speculative_disable_by_batch_size``), unless the deployment forces it on;
2. measures each sequence's acceptance and picks ``k`` to maximise expected tokens per unit of cost.
   Under Leviathan et al.'s model (each draft accepted with probability ``alpha``, independently), a
   step with ``k`` drafts yields ``(1 - alpha ** (k + 1)) / (1 - alpha)`` tokens and costs
   ``1 + k * c`` token-steps; ``k = 0`` (plain decode) yields 1 for 1. ``alpha`` is estimated from
   decayed counts of accepted and rejected drafts (a rejection ends a run),
   ``(accepted + 1) / (accepted + rejected + 2)``; the counts decay at every decision, so a sequence
   whose drafts stopped paying is re-tried once its old rejections fade;
3. prices a verified position by the machine's measured step cost (:class:`StepCostModel`): a step over
   ``T`` tokens takes ``w + T * t`` seconds (``w`` reading the weights and fixed costs, ``t`` per token),
   fitted online to the steps that only decode or verify. One more position in a step of ``B`` running
   sequences costs ``t`` while the step yields ``B`` tokens in ``w + B * t``, so speculating pays when
   its extra tokens beat ``k * c`` with ``c = B * t / (w + B * t)``, the share of the step that one
   token's worth of rows takes: small at batch 1, near 1 in a large batch.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past per decision: about the last five draft steps count
# The step cost before any measurement: a token's rows cost this fraction of the fixed part of a step (t / w).
PRIOR_TOKEN_COST = 0.1
COST_DECAY = 0.98  # weight of the past per observed step: about the last 50 steps count
MIN_TOKEN_SPREAD = 1.0  # the fit needs steps of different sizes: variance of the token counts >= this


class StepCostModel:
    """Seconds of a decode step as ``w + num_tokens * t``, a least-squares line over recent steps.

    Observed steps are those without prompt tokens (plain decodes and verifications), weighted by
    ``COST_DECAY`` per step. Until their token counts spread (``MIN_TOKEN_SPREAD``) or when the fit is not
    positive, ``t / w`` is ``PRIOR_TOKEN_COST``.
    """

    def __init__(self) -> None:
        self._weight = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Count one step of ``num_tokens`` scheduled tokens that took ``seconds``."""
        self._weight = self._weight * COST_DECAY + 1.0
        self._x = self._x * COST_DECAY + num_tokens
        self._y = self._y * COST_DECAY + seconds
        self._xx = self._xx * COST_DECAY + num_tokens * num_tokens
        self._xy = self._xy * COST_DECAY + num_tokens * seconds

    def token_cost_ratio(self) -> float:
        """``t / w``: one token's rows relative to the fixed part of a step."""
        if self._weight > 0.0:
            mean_x, mean_y = self._x / self._weight, self._y / self._weight
            var_x = self._xx / self._weight - mean_x * mean_x
            if var_x >= MIN_TOKEN_SPREAD:
                per_token = (self._xy / self._weight - mean_x * mean_y) / var_x
                fixed = mean_y - per_token * mean_x
                if per_token > 0.0 and fixed > 0.0:
                    return per_token / fixed
        return PRIOR_TOKEN_COST

    def row_share(self, num_rows: int) -> float:
        """``B * t / (w + B * t)`` for ``B = num_rows``: the cost of one verified position relative to the
        tokens a step of ``num_rows`` plain decodes yields (module docstring, 3)."""
        ratio = self.token_cost_ratio()
        return num_rows * ratio / (1.0 + num_rows * ratio)


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
        proposer_cost_per_token: the proposer's cost of one draft token relative to a decode step.
        tree_width: nodes per depth of the proposer's trees (1: chains): a step of depth ``k`` verifies
            ``tree_width * k`` rows, so each depth costs ``tree_width`` rows; its acceptance is measured per depth.

    Raises:
        ValueError: on a non-positive ``max_spec_tokens`` or ``disable_by_batch_size``, or a negative cost.
    """

    def __init__(
        self,
        *,
        force: bool,
        max_spec_tokens: int,
        disable_by_batch_size: int,
        proposer_cost_per_token: float,
        tree_width: int = 1,
    ) -> None:
        if max_spec_tokens < 1 or disable_by_batch_size < 1 or proposer_cost_per_token < 0:
            raise ValueError("max_spec_tokens and disable_by_batch_size must be >= 1, proposer_cost_per_token >= 0")
        self.force = force
        self.max_spec_tokens = max_spec_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.proposer_cost_per_token = proposer_cost_per_token
        self.tree_width = max(1, tree_width)
        self.step_cost = StepCostModel()
        self._acceptance: dict[int, _Acceptance] = {}

    def batch_speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running sequences speculates at all."""
        return self.force or num_running <= self.disable_by_batch_size

    def cost_per_token(self, num_running: int) -> float:
        """Cost of one draft depth (its ``tree_width`` verified rows plus the proposal) in a step of
        ``num_running`` sequences."""
        return self.tree_width * self.step_cost.row_share(num_running) + self.proposer_cost_per_token

    def num_spec_tokens(self, seq_id: int, num_running: int) -> int:
        """Drafts to propose for ``seq_id`` in a step of ``num_running`` sequences (0: decode plainly);
        decays its counts."""
        return self.plan(seq_id, num_running)[0]

    def plan(self, seq_id: int, num_running: int) -> tuple[int, float]:
        """``(k, tokens per unit of cost)`` of the best ``k`` for ``seq_id`` (``k = 0``: rate 1); decays its counts.
        Forced, ``k`` is at least 1 (its rate reported as computed)."""
        acceptance = self._acceptance.setdefault(seq_id, _Acceptance())
        alpha = acceptance.rate
        acceptance.accepted *= DECAY
        acceptance.rejected *= DECAY
        cost = self.cost_per_token(num_running)
        best_k, best_rate = 0, 1.0
        for k in range(1, self.max_spec_tokens + 1):
            rate = expected_tokens(alpha, k) / (1.0 + k * cost)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if self.force and best_k == 0:
            return 1, expected_tokens(alpha, 1) / (1.0 + cost)
        return best_k, best_rate

    def record(self, seq_id: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``seq_id``: ``num_accepted_tokens`` of ``num_draft_tokens`` accepted."""
        acceptance = self._acceptance.setdefault(seq_id, _Acceptance())
        acceptance.accepted += num_accepted_tokens
        acceptance.rejected += 1.0 if num_accepted_tokens < num_draft_tokens else 0.0

    def free(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)
