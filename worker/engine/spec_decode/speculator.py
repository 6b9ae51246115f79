"""The per-step glue of speculative decoding: who speculates, the proposals, the counters.

Before each step the engine asks :meth:`Speculator.propose` for drafts: running sequences about to
decode get ``seq.spec_token_ids`` (the scheduler schedules them after the last token, the model runner
verifies them in the same ragged batch as every other sequence). After the step :meth:`record` counts
the verification (vLLM's spec-decoding counters) and feeds the policy, and :meth:`observe_step` gives the
policy the step's duration.

Who may speculate (docs/engine.md, "Speculative decoding"): a sequence decoding one token at a time
(not beam search). Under ``"auto"`` only lines whose output cannot depend on the decision: greedy lines
(the same ids, up to the near-tie rule) and unseeded sampled lines (the same distribution). A seeded
sampled line keeps its reproducible stream (its draws would differ with speculation, and the automatic
decision depends on the batch); ``"on"`` speculates it too. In a job's tail (nothing waiting) ``"auto"``
lets only the sequences that may finish last speculate (:meth:`Speculator.propose`). No request parameter
turns speculation on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.config import EngineConfig
from worker.engine.core.request import Sequence, SequenceStatus
from worker.engine.executor.layers.attention.tree import tree_depths
from worker.engine.spec_decode.ngram_proposer import NgramProposer
from worker.engine.spec_decode.policy import SpecDecodePolicy
from worker.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    import torch

    from worker.engine.executor.model_runner import ModelRunner


@dataclass(slots=True)
class SpecDecodingStats:
    """vLLM's spec-decoding counters: ``num_drafts`` (sequence-steps that verified drafts),
    ``num_draft_tokens``, ``num_accepted_tokens``, and ``num_accepted_tokens_per_pos[j]``: drafts accepted
    at draft position ``j``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_accepted_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_accepted_tokens - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1


class Speculator:
    """Proposes drafts for the running sequences that the policy lets speculate.

    Args:
        proposer: the drafter (n-gram lookup or a draft model).
        policy: the batch gate and per-sequence ``k``.
        force: the deployment forced speculation on (seeded sampled lines speculate too).
        max_model_len: prompt + output tokens a sequence may hold.
    """

    def __init__(self, proposer: Proposer, policy: SpecDecodePolicy, *, force: bool, max_model_len: int) -> None:
        self.proposer = proposer
        self.policy = policy
        self.force = force
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats()

    def make_stats(self) -> SpecDecodingStats:
        """The counters since the last call (take and reset)."""
        stats, self.stats = self.stats, SpecDecodingStats()
        return stats

    def eligible(self, seq: Sequence) -> bool:
        """Whether ``seq`` may speculate this step: running, about to decode its next token, not a beam,
        and (unless forced) greedy or unseeded."""
        params = seq.params
        return (
            seq.status is SequenceStatus.RUNNING
            and bool(seq.output_token_ids)
            and seq.num_computed_tokens == seq.num_tokens - 1
            and not params.use_beam_search
            and (self.force or params.is_greedy or params.seed is None)
        )

    def max_useful_tokens(self, seq: Sequence) -> int:
        """Drafts that could still be kept: a step yields accepted drafts + 1 tokens, within ``max_tokens``
        and the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids))
        return room - 1

    def propose(self, running: list[Sequence], num_waiting: int) -> dict[int, torch.Tensor]:
        """Set ``spec_token_ids`` on the running sequences that speculate this step.

        With nothing waiting (``num_waiting == 0``, the tail of a job) and speculation not forced, only
        the running sequences with the most tokens left to generate (:meth:`max_useful_tokens`) may
        speculate: a step's fixed cost is paid until the last sequence finishes, so only drafts accepted
        by a sequence that may finish last shorten the job; any other sequence's drafts add verified rows
        to steps that run anyway (docs/engine.md, "Speculative decoding").

        Returns:
            the draft distributions of proposals that have them, by ``seq_id`` (float32
            ``[k, vocab_size]``; absent: one-hot drafts).
        """
        if not running or not self.policy.batch_speculates(len(running)):
            return {}
        useful = [self.max_useful_tokens(seq) for seq in running]
        longest = max(useful) if num_waiting == 0 and not self.force else 0
        seqs, ks = [], []
        for seq, max_useful in zip(running, useful, strict=True):
            if not self.eligible(seq) or max_useful < longest:
                continue
            k = min(self.policy.num_spec_tokens(seq.seq_id, len(running)), max_useful)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return {}
        draft_probs = {}
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, ks), strict=True):
            seq.spec_token_ids = list(proposal.token_ids)
            parents = proposal.parent_idx
            # A tree that is a chain takes the chain path (no tree mask).
            is_tree = parents is not None and any(parent != i - 1 for i, parent in enumerate(parents))
            seq.spec_parent_idx = list(parents) if parents is not None and is_tree and proposal.token_ids else None
            if proposal.probs is not None and proposal.token_ids:
                draft_probs[seq.seq_id] = proposal.probs
        return draft_probs

    def record(self, seq: Sequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``seq`` (counters and the policy's acceptance estimate).

        The counters count every verified draft, a tree's every node; the policy sees a tree as the chain of its
        depth (its acceptance rate is per position along one path, which a tree's extra branches only raise)."""
        self.stats.observe(num_draft_tokens, num_accepted_tokens)
        if seq.spec_parent_idx is not None:
            num_draft_tokens = max(tree_depths(seq.spec_parent_idx))
        self.policy.record(seq.seq_id, num_draft_tokens, num_accepted_tokens)

    def observe_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int], seconds: float) -> None:
        """Feed the policy's step-cost model a step that only decoded or verified (no prompt tokens):
        ``seqs[i]`` computed ``num_scheduled_tokens[i]`` tokens in ``seconds`` (forward and sampling)."""
        if all(seq.output_token_ids and n == 1 + len(seq.spec_token_ids) for seq, n in zip(seqs, num_scheduled_tokens)):
            self.policy.step_cost.observe(sum(num_scheduled_tokens), seconds)

    def free(self, seqs: Iterable[Sequence], *, finished: bool) -> None:
        """Drop the proposer's state of ``seqs`` (preempted or finished); finished ones leave the policy too."""
        seqs = list(seqs)
        self.proposer.free(seqs)
        if finished:
            for seq in seqs:
                self.policy.free(seq.seq_id)


def build_speculator(config: EngineConfig, model_runner: ModelRunner, max_model_len: int) -> Speculator | None:
    """The engine's speculator for ``config`` (None when ``speculative_mode`` is ``"off"``).

    Raises:
        ValueError: as the draft-model proposer (a draft that cannot serve this target), or as
            :func:`build_head_proposer`.
    """
    if config.speculative_mode == "off":
        return None
    proposer: Proposer
    if config.speculative_method == "ngram":
        # NOTE: the kernels' tree mask has no sliding window: such models verify chains.
        tree_width = config.speculative_tree_width if model_runner.sliding_window is None else 1
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, tree_width)
    elif config.speculative_method in ("eagle", "medusa"):
        proposer = build_head_proposer(config, model_runner)
    else:
        from worker.engine.spec_decode.draft_model_proposer import DraftModelProposer

        proposer = DraftModelProposer.build(config, model_runner)
    force = config.speculative_mode == "on"
    policy = SpecDecodePolicy(
        force=force,
        max_spec_tokens=config.num_speculative_tokens,
        disable_by_batch_size=config.speculative_disable_by_batch_size,
        proposer_cost_per_token=proposer.cost_per_token,
    )
    return Speculator(proposer, policy, force=force, max_model_len=max_model_len)


def build_head_proposer(config: EngineConfig, model_runner: ModelRunner) -> Proposer:
    """The EAGLE or Medusa proposer (``config.speculative_method``) over the heads in ``speculative_model``, by
    default ``<model>/heads/<method>`` (written by ``batchinfer heads train``); it receives the target's hidden
    states through the model runner's ``hidden_states_sink``.

    Raises:
        ValueError: no heads in that folder (naming ``batchinfer heads train``), or heads of the other method,
            or heads that do not fit the target (their hidden size).
    """
    from worker.engine.spec_decode.eagle_proposer import EagleProposer
    from worker.engine.spec_decode.heads.eagle import EagleHead
    from worker.engine.spec_decode.heads.storage import default_heads_dir, load_head
    from worker.engine.spec_decode.medusa_proposer import MedusaProposer

    method = config.speculative_method
    folder = config.speculative_model or str(default_heads_dir(config.model, method))
    target = model_runner.model
    try:
        head = load_head(
            folder, hidden_size=int(target.config.hidden_size), dtype=model_runner.dtype, device=model_runner.device
        )
    except FileNotFoundError as exc:
        raise ValueError(
            f"speculative_method={method!r} needs trained heads: {exc}; train them with `batchinfer heads train "
            f"--method {method}`"
        ) from None
    proposer: EagleProposer | MedusaProposer
    if method == "eagle":
        if not isinstance(head, EagleHead):
            raise ValueError(f"{folder} holds Medusa heads, not an EAGLE head")
        proposer = EagleProposer(head, target, model_runner.eos_token_id)
    else:
        if isinstance(head, EagleHead):
            raise ValueError(f"{folder} holds an EAGLE head, not Medusa heads")
        proposer = MedusaProposer(head, target, model_runner.eos_token_id)
    model_runner.hidden_states_sink = proposer.observe
    return proposer
