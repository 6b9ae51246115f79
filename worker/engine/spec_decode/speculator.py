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

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.engine.config import EngineConfig
from worker.engine.core.request import Sequence, SequenceStatus
from worker.engine.executor.layers.attention.tree import tree_depths
from worker.engine.spec_decode.ngram_proposer import NgramProposer
from worker.engine.spec_decode.policy import SpecDecodePolicy
from worker.engine.spec_decode.proposer import DraftProposal, Proposer

if TYPE_CHECKING:
    import torch

    from worker.engine.executor.model_runner import ModelRunner
    from worker.engine.spec_decode.eagle_proposer import EagleProposer
    from worker.engine.spec_decode.medusa_proposer import MedusaProposer

    HeadProposer = EagleProposer | MedusaProposer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecDecodingStats:
    """vLLM's spec-decoding counters: ``num_drafts`` (sequence-steps that verified drafts),
    ``num_draft_tokens``, ``num_accepted_tokens``, and ``num_accepted_tokens_per_pos[j]``: drafts accepted
    at draft position ``j``; ``by_method``: the first three per proposer method (``[drafts, draft tokens,
    accepted]``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    by_method: dict[str, list[int]] = field(default_factory=dict)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int, method: str) -> None:
        counts = self.by_method.setdefault(method, [0, 0, 0])
        counts[0] += 1
        counts[1] += num_draft_tokens
        counts[2] += num_accepted_tokens
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
        proposer: the drafter (n-gram lookup, a draft model, heads).
        policy: the batch gate and per-sequence ``k``.
        force: the deployment forced speculation on (seeded sampled lines speculate too).
        max_model_len: prompt + output tokens a sequence may hold.
        alternatives: other drafters, each with its own policy (sharing ``policy.step_cost``), for
            ``speculative_method="auto"``: each sequence and step takes the drafter whose policy promises the most
            tokens per unit of cost (:meth:`SpecDecodePolicy.plan`; ties go to ``proposer``, then in order).
    """

    def __init__(
        self,
        proposer: Proposer,
        policy: SpecDecodePolicy,
        *,
        force: bool,
        max_model_len: int,
        alternatives: list[tuple[Proposer, SpecDecodePolicy]] | None = None,
    ) -> None:
        self.proposer = proposer
        self.policy = policy
        self.alternatives = list(alternatives or [])
        self.force = force
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats()
        # The policy each speculating sequence's drafts of this step came from (for record()).
        self._chosen: dict[int, tuple[str, SpecDecodePolicy]] = {}

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
        groups: dict[int, tuple[Proposer, list[Sequence], list[int]]] = {}
        for seq, max_useful in zip(running, useful, strict=True):
            if not self.eligible(seq) or max_useful < longest:
                continue
            proposer, policy, k = self._choose(seq.seq_id, len(running))
            k = min(k, max_useful)
            if k > 0:
                self._chosen[seq.seq_id] = (proposer.method, policy)
                group = groups.setdefault(id(proposer), (proposer, [], []))
                group[1].append(seq)
                group[2].append(k)
        draft_probs: dict[int, torch.Tensor] = {}
        for proposer, seqs, ks in groups.values():
            self._apply(seqs, proposer.propose(seqs, ks), draft_probs)
        return draft_probs

    def _choose(self, seq_id: int, num_running: int) -> tuple[Proposer, SpecDecodePolicy, int]:
        """The drafter for ``seq_id`` this step and its ``k`` (every policy's plan is made, so all decay alike)."""
        best = (self.proposer, self.policy, *self.policy.plan(seq_id, num_running))
        for proposer, policy in self.alternatives:
            k, rate = policy.plan(seq_id, num_running)
            if k > 0 and (best[2] == 0 or rate > best[3]):
                best = (proposer, policy, k, rate)
        return best[0], best[1], best[2]

    @staticmethod
    def _apply(seqs: list[Sequence], proposals: list[DraftProposal], draft_probs: dict[int, torch.Tensor]) -> None:
        for seq, proposal in zip(seqs, proposals, strict=True):
            seq.spec_token_ids = list(proposal.token_ids)
            parents = proposal.parent_idx
            # A tree that is a chain takes the chain path (no tree mask).
            is_tree = parents is not None and any(parent != i - 1 for i, parent in enumerate(parents))
            seq.spec_parent_idx = list(parents) if parents is not None and is_tree and proposal.token_ids else None
            if proposal.probs is not None and proposal.token_ids:
                draft_probs[seq.seq_id] = proposal.probs

    def record(self, seq: Sequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``seq`` (counters and the policy's acceptance estimate).

        The counters count every verified draft, a tree's every node; the policy sees a tree as the chain of its
        depth (its acceptance rate is per position along one path, which a tree's extra branches only raise)."""
        method, policy = self._chosen.get(seq.seq_id, (self.proposer.method, self.policy))
        self.stats.observe(num_draft_tokens, num_accepted_tokens, method)
        if seq.spec_parent_idx is not None:
            num_draft_tokens = max(tree_depths(seq.spec_parent_idx))
        policy.record(seq.seq_id, num_draft_tokens, num_accepted_tokens)

    def observe_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int], seconds: float) -> None:
        """Feed the policy's step-cost model a step that only decoded or verified (no prompt tokens):
        ``seqs[i]`` computed ``num_scheduled_tokens[i]`` tokens in ``seconds`` (forward and sampling)."""
        if all(seq.output_token_ids and n == 1 + len(seq.spec_token_ids) for seq, n in zip(seqs, num_scheduled_tokens)):
            self.policy.step_cost.observe(sum(num_scheduled_tokens), seconds)

    def free(self, seqs: Iterable[Sequence], *, finished: bool) -> None:
        """Drop the proposer's state of ``seqs`` (preempted or finished); finished ones leave the policy too."""
        seqs = list(seqs)
        for proposer, policy in [(self.proposer, self.policy), *self.alternatives]:
            proposer.free(seqs)
            if finished:
                for seq in seqs:
                    policy.free(seq.seq_id)
        for seq in seqs:
            self._chosen.pop(seq.seq_id, None)


def build_speculator(config: EngineConfig, model_runner: ModelRunner, max_model_len: int) -> Speculator | None:
    """The engine's speculator for ``config`` (None when ``speculative_mode`` is ``"off"``).

    ``speculative_method="auto"``: n-gram lookup, with the EAGLE and Medusa heads found beside the model as
    alternatives chosen per sequence and step (:class:`Speculator`).

    Raises:
        ValueError: as the draft-model proposer (a draft that cannot serve this target), or as
            :func:`build_head_proposer`.
    """
    if config.speculative_mode == "off":
        return None
    # NOTE: the kernels' tree mask has no sliding window: such models verify chains.
    tree_width = config.speculative_tree_width if model_runner.sliding_window is None else 1
    proposer: Proposer
    alternatives: list[Proposer] = []
    if config.speculative_method in ("ngram", "auto"):
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, tree_width)
        if config.speculative_method == "auto":
            alternatives = found_head_proposers(config, model_runner, tree_width)
    elif config.speculative_method in ("eagle", "medusa"):
        head_proposer = build_head_proposer(config, model_runner, config.speculative_method, tree_width)
        model_runner.hidden_states_sink = head_proposer.observe
        proposer = head_proposer
    else:
        from worker.engine.spec_decode.draft_model_proposer import DraftModelProposer

        proposer = DraftModelProposer.build(config, model_runner)
    force = config.speculative_mode == "on"

    def policy_for(drafter: Proposer) -> SpecDecodePolicy:
        max_depth = drafter.max_depth or config.num_speculative_tokens
        return SpecDecodePolicy(
            force=force,
            max_spec_tokens=min(config.num_speculative_tokens, max_depth),
            disable_by_batch_size=config.speculative_disable_by_batch_size,
            proposer_cost_per_token=drafter.cost_per_token,
            tree_width=drafter.tree_width,
        )

    policy = policy_for(proposer)
    others = []
    for alternative in alternatives:
        other = policy_for(alternative)
        other.step_cost = policy.step_cost
        others.append((alternative, other))
    return Speculator(proposer, policy, force=force, max_model_len=max_model_len, alternatives=others)


def found_head_proposers(config: EngineConfig, model_runner: ModelRunner, tree_width: int) -> list[Proposer]:
    """The EAGLE and Medusa proposers of the heads found in ``<model>/heads/`` (none: an empty list), all fed the
    target's hidden states. A folder whose heads do not load (:func:`build_head_proposer`'s errors: missing or
    truncated weights, a wrong config, heads of another model) is logged as a warning and left out, so a broken
    folder costs that method, never the engine."""
    from worker.engine.spec_decode.heads.storage import HEAD_METHODS, default_heads_dir

    proposers: list[HeadProposer] = []
    for method in HEAD_METHODS:
        if not (default_heads_dir(config.model, method) / "config.json").is_file():
            continue
        try:
            proposers.append(build_head_proposer(config, model_runner, method, tree_width))
        except ValueError as exc:
            logger.warning("speculative_method='auto': %s heads left out: %s", method, exc)
    if proposers:
        sinks = [proposer.observe for proposer in proposers]

        def observe(*args: Any) -> None:
            for sink in sinks:
                sink(*args)

        model_runner.hidden_states_sink = observe
    return list(proposers)


def build_head_proposer(config: EngineConfig, model_runner: ModelRunner, method: str, tree_width: int) -> HeadProposer:
    """The EAGLE or Medusa proposer (``method``) over the heads in ``speculative_model`` (when ``method`` is
    ``config.speculative_method``), by default ``<model>/heads/<method>`` (written by ``batchinfer heads train``),
    drafting trees of ``tree_width`` for greedy lines; the caller feeds its ``observe`` the target's hidden states
    (the model runner's ``hidden_states_sink``).

    Raises:
        ValueError: no heads in that folder (naming ``batchinfer heads train``), or heads of the other method,
            or heads that do not fit the target (their hidden size; Medusa's own LM heads or a draft vocabulary
            over another vocabulary size), or a folder :func:`load_head` cannot read.
    """
    from worker.engine.spec_decode.eagle_proposer import EagleProposer
    from worker.engine.spec_decode.heads.eagle import EagleHead
    from worker.engine.spec_decode.heads.medusa import MedusaHeads
    from worker.engine.spec_decode.heads.storage import default_heads_dir, load_draft_vocab, load_head
    from worker.engine.spec_decode.medusa_proposer import MedusaProposer

    given = config.speculative_model if method == config.speculative_method else None
    folder = given or str(default_heads_dir(config.model, method))
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
    vocab_size = int(target.config.vocab_size)
    try:
        draft_vocab = load_draft_vocab(folder)
    except Exception as exc:  # safetensors' errors of a truncated file
        raise ValueError(f"{folder}: its draft vocabulary cannot be read ({type(exc).__name__}: {exc})") from None
    if (
        draft_vocab is not None
        and draft_vocab.numel()
        and not 0 <= int(draft_vocab.min()) <= int(draft_vocab.max()) < vocab_size
    ):
        raise ValueError(
            f"{folder}: its draft vocabulary has token ids outside the target's vocabulary of {vocab_size} "
            "(heads trained for another model?)"
        )
    if isinstance(head, MedusaHeads) and head.own_lm_heads and head.vocab_size != vocab_size:
        raise ValueError(
            f"{folder}: the Medusa heads' own LM heads have {head.vocab_size} rows, the target's vocabulary "
            f"{vocab_size} (heads trained for another model?)"
        )
    proposer: EagleProposer | MedusaProposer
    if method == "eagle":
        if not isinstance(head, EagleHead):
            raise ValueError(f"{folder} holds Medusa heads, not an EAGLE head")
        proposer = EagleProposer(head, target, model_runner.eos_token_id, draft_vocab, tree_width)
    else:
        if isinstance(head, EagleHead):
            raise ValueError(f"{folder} holds an EAGLE head, not Medusa heads")
        proposer = MedusaProposer(head, target, model_runner.eos_token_id, draft_vocab, tree_width)
    return proposer
