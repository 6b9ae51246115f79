"""Iteration-level scheduler with chunked prefill and recompute preemption (pure Python).

vLLM V1's scheduler (docs.vllm.ai, "vLLM V1" design; Yu et al. 2022, "Orca", for iteration-level
scheduling): there is no prefill/decode phase, each sequence simply has ``num_tokens -
num_computed_tokens`` tokens left to compute. Each step spends a budget of ``max_num_batched_tokens``:

1. running sequences in admission order (oldest first), so decodes come first; a sequence still in its
   prefill gets what is left of the budget (chunked prefill) and continues next step. A running sequence
   is always at most one chunked prefill behind the decodes: it takes all the budget left, so nothing
   younger is admitted until it finishes its prompt.
2. When a block table cannot grow, the youngest running sequence is preempted: its blocks are freed, it
   goes back to the FRONT of the waiting queue, and later recomputes prompt + generated tokens.
3. If nothing was preempted, waiting sequences are admitted while budget, ``max_num_seqs`` and blocks
   last, each starting after its longest prefix-cache hit. Among the first ``admission_lookahead``
   waiting sequences, preempted ones go first, then the longest cached prefix, then first come, first
   served; a sequence passed over while at the head of the queue goes first in the next step, so none
   starves.
4. Forks (parallel sampling, Kwon et al. 2023, section 4.4): a scheduled sequence whose prompt
   completes this step and that has ``pending_forks`` is listed in ``SchedulerOutput.forks``; once the
   step ran (``update_from_output``) each pending branch gets its block table by reference and joins
   the running batch, and samples its first token from the same logits row. A sequence with pending
   forks counts ``1 + len(pending_forks)`` against ``max_num_seqs`` at admission (unless nothing runs).
5. Shared-prefix hold (beyond vLLM): a waiting sequence whose next uncached full block is the very block
   a running sequence (or one admitted earlier in this step) is about to compute is held back: once
   that block is computed it is a cache hit, instead of every sibling prefilling the shared prefix in
   the same batch. The hold lasts at most until the owner's prefill has passed the shared blocks.
6. Long-RoPE recompute (Phi-3 ``longrope``, as Hugging Face's Phi-3 drops its cache at that point): a
   running sequence whose K were computed with the short factors and that has just grown past
   ``original_max_position_embeddings`` is sent back to recompute all its tokens with the long ones
   (:meth:`KVCacheManager.needs_recompute`), before anything else is scheduled; it counts as a preemption.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from worker.engine.core.block_pool import BlockHash, BlockId
from worker.engine.core.kv_cache_manager import KVCacheManager
from worker.engine.core.request import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """What to compute this step: ``seqs[i]`` gets its next ``num_scheduled_tokens[i]`` tokens.

    Sequences appear in batch order (the runner lays out tokens the same way). ``preempted_seqs`` were
    moved back to waiting during this step's scheduling. ``blocks_to_copy`` are the copy-on-write block
    copies ``(src, dst)`` (physical block ids) the runner executes before the forward pass.
    ``forks`` pairs each scheduled sequence whose prompt completes this step with the branches forked
    off it after the forward pass; they sample from its logits row.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_seqs: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class SchedulerStats:
    """Scheduler counters: ``num_preemptions`` (running sequences sent back to recompute) and
    ``num_prefix_holds`` (admissions deferred because a running sibling was computing the same prefix block)."""

    num_preemptions: int = 0
    num_prefix_holds: int = 0


class Scheduler:
    """Moves sequences between ``waiting`` (a deque, FCFS) and ``running`` (admission order) each step."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        admission_lookahead: int = 32,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.admission_lookahead = admission_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        # The head of ``waiting`` at the end of the last step if it was passed over (it goes first next).
        self._passed_over_head: Sequence | None = None

    def make_stats(self) -> SchedulerStats:
        """The counters since the last call (take and reset)."""
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    def add_seq(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of ``waiting``."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work under the token budget; allocates slots, may preempt (mutates queues)."""
        kv = self.kv_cache_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if kv.long_rope_len is not None:
            for seq in [seq for seq in self.running if kv.needs_recompute(seq)]:
                if seq in self.running:  # not already sent back with its beam group
                    self._preempt_group(seq)

        handled = 0  # running[:handled] are scheduled this step, or beams waiting for their siblings
        while handled < len(self.running) and budget > 0:
            seq = self.running[handled]
            num_known = seq.num_tokens - seq.num_computed_tokens
            num_new_tokens = min(num_known + len(seq.spec_token_ids), budget)
            if num_new_tokens == 0:  # a beam waiting for its siblings' candidates
                handled += 1
                continue
            # Draft tokens beyond the budget are dropped (the verification extends fewer positions).
            del seq.spec_token_ids[max(num_new_tokens - num_known, 0) :]
            if seq.spec_parent_idx is not None:  # a prefix of a tree's nodes is a tree (parents come first)
                del seq.spec_parent_idx[len(seq.spec_token_ids) :]
            while not kv.allocate_slots(seq, num_new_tokens):
                num_handled = handled
                for position, victim in self._preempt_group(self.running[-1]):
                    out.preempted_seqs.append(victim)
                    if position < num_handled:  # already scheduled (or idle) this step: take it back
                        handled -= 1
                        if victim in out.seqs:
                            idx = out.seqs.index(victim)
                            out.seqs.pop(idx)
                            budget += out.num_scheduled_tokens.pop(idx)
                if seq.status is SequenceStatus.PREEMPTED:
                    break
            else:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_new_tokens)
                budget -= num_new_tokens
                handled += 1

        # NOTE: admitting new work in a step that had to preempt would only evict it again.
        if not out.preempted_seqs and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            budget = self._admit(out, budget)

        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        out.blocks_to_copy = kv.take_blocks_to_copy()
        out.forks = [
            (seq, [child for child in seq.pending_forks if child.status is SequenceStatus.FORK_PENDING])
            for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens, strict=True)
            if seq.pending_forks and seq.num_computed_tokens + num_tokens == seq.num_tokens
        ]
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in preference order (module docstring, 3 and 4); returns the budget left."""
        kv = self.kv_cache_manager
        window = list(itertools.islice(self.waiting, self.admission_lookahead))
        head = window[0]
        ranked = sorted(
            range(len(window)),
            key=lambda i: (
                not (window[i].status is SequenceStatus.PREEMPTED or (i == 0 and head is self._passed_over_head)),
                -kv.get_computed_blocks(window[i])[1],
                i,
            ),
        )
        pending: set[BlockHash] = set()
        if kv.enable_caching:
            pending = {h for seq in self.running if (h := kv.next_block_hash(seq)) is not None}
        admitted: set[int] = set()
        for index in ranked:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            seq = window[index]
            if id(seq) in admitted:  # came in with its beam group
                continue
            if seq.params.use_beam_search:
                group = [seq] + [
                    other for other in self.waiting if other is not seq and other.request_id == seq.request_id
                ]
                if len(group) > 1:
                    if self.running and len(self.running) + len(group) > self.max_num_seqs:
                        continue
                    left = self._admit_beam_group(out, group, budget)
                    if left is None:  # waits for blocks; others may still fit (and finish, freeing them)
                        continue
                    admitted.update(id(member) for member in group)
                    budget = left
                    continue
            if self.running and len(self.running) + 1 + len(seq.pending_forks) > self.max_num_seqs:
                continue
            # Lookups again: admitting the sequences ranked before may have evicted blocks.
            computed_blocks, num_cached_tokens = kv.get_computed_blocks(seq)
            next_hash = kv.next_block_hash(seq, computed_blocks)
            if next_hash is not None and next_hash in pending:
                self.stats.num_prefix_holds += 1
                continue
            num_new_tokens = min(seq.num_tokens - num_cached_tokens, budget)
            if not kv.allocate_slots(seq, num_new_tokens, computed_blocks):
                break
            kv.record_prefix_lookup(seq.num_tokens, num_cached_tokens)
            if next_hash is not None:
                pending.add(next_hash)
            admitted.add(id(seq))
            seq.num_computed_tokens = num_cached_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new_tokens)
            budget -= num_new_tokens
        if admitted:
            kept = [seq for seq in window if id(seq) not in admitted]
            for _ in window:
                self.waiting.popleft()
            if len(admitted) > len(window) - len(kept):  # beam-group members from beyond the window
                self.waiting = deque(seq for seq in self.waiting if id(seq) not in admitted)
            self.waiting.extendleft(reversed(kept))
        self._passed_over_head = head if self.waiting and self.waiting[0] is head else None
        return budget

    def _admit_beam_group(self, out: SchedulerOutput, group: list[Sequence], budget: int) -> int | None:
        """Admit a preempted beam group all or nothing, with blocks for every beam's whole recompute;
        schedule what the budget allows (the rest runs in later steps). Returns the budget left, or None
        (nothing admitted) when the blocks are not there.

        All or nothing for the reason :meth:`_preempt_group` gives: beams admitted without their
        siblings would hold blocks waiting for them.
        """
        kv = self.kv_cache_manager
        allocated: list[tuple[Sequence, int]] = []
        for member in group:
            computed_blocks, num_cached_tokens = kv.get_computed_blocks(member)
            if not kv.allocate_slots(member, member.num_tokens - num_cached_tokens, computed_blocks):
                for done, _ in allocated:
                    kv.free(done)
                return None
            allocated.append((member, num_cached_tokens))
        for member, num_cached_tokens in allocated:
            kv.record_prefix_lookup(member.num_tokens, num_cached_tokens)
            member.num_computed_tokens = num_cached_tokens
            member.status = SequenceStatus.RUNNING
            self.running.append(member)
            num_new_tokens = min(member.num_tokens - num_cached_tokens, budget)
            if num_new_tokens > 0:
                out.seqs.append(member)
                out.num_scheduled_tokens.append(num_new_tokens)
                budget -= num_new_tokens
        return budget

    def _preempt_group(self, victim: Sequence) -> list[tuple[int, Sequence]]:
        """Preempt ``victim`` and, under beam search, every running beam of its request; returns each
        preempted sequence with the position it held in ``running``.

        Beams wait for each other's candidates every step, so a beam group moves as one: a beam left
        running would hold its blocks waiting for a preempted sibling that needs them to come back
        (vLLM V0 likewise preempts whole sequence groups).
        """
        group = {id(victim)}
        if victim.params.use_beam_search:
            group |= {id(seq) for seq in self.running if seq.request_id == victim.request_id}
        preempted = [(position, seq) for position, seq in enumerate(self.running) if id(seq) in group]
        self.running = [seq for seq in self.running if id(seq) not in group]
        # NOTE: back to the head of waiting in running order, so the group is admitted in that order.
        for _, seq in reversed(preempted):
            self._preempt(seq)
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.spec_token_ids = []
        seq.spec_parent_idx = None
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed (the forward pass ran), offer full blocks to the prefix cache,
        and fork ``out.forks``' branches off their parents (they join the running batch).

        A sequence that verified draft tokens (``spec_token_ids``) must already hold its accepted tokens
        (the engine appends them first): its computed tokens end before its last token, the slots of
        rejected drafts are rolled back and blocks that held only rejected drafts are freed
        (``KVCacheManager.trim_slots``), and its drafts are cleared.
        """
        kv = self.kv_cache_manager
        for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            if seq.spec_token_ids:
                seq.num_computed_tokens = min(seq.num_computed_tokens + num_tokens, seq.num_tokens - 1)
                seq.spec_token_ids = []
                seq.spec_parent_idx = None
                kv.trim_slots(seq)
            else:
                seq.num_computed_tokens += num_tokens
            kv.cache_blocks(seq)
        for parent, children in out.forks:
            parent.pending_forks = []
            for child in children:
                child.num_computed_tokens = parent.num_computed_tokens
                kv.fork(parent, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Add ``child``, a fork of ``parent`` (``Sequence.fork``) made after a step: a running parent shares
        its blocks with it (copy-on-write, or copies them with forks disabled) and it runs; the child of a
        preempted parent, or one the pool has no blocks to copy into, waits to recompute."""
        if parent.status is SequenceStatus.RUNNING and self.kv_cache_manager.fork(parent, child):
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.PREEMPTED
            self.waiting.appendleft(child)

    def finish_seqs(self, seqs: Iterable[Sequence]) -> None:
        """Mark ``seqs`` finished (or aborted), wherever they are, and free their blocks at once."""
        done = set()
        for seq in seqs:
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.RUNNING:
                done.add(id(seq))
            seq.status = SequenceStatus.FINISHED
            self.kv_cache_manager.free(seq)
        if done:
            self.running = [seq for seq in self.running if id(seq) not in done]
