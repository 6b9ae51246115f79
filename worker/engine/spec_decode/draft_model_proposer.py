"""Draft-model proposer: a smaller causal LM drafts ``k`` tokens autoregressively from its own paged KV cache.

Leviathan et al. 2023 and Chen et al. 2023 (draft model + rejection sampling). The draft may be any local
causal LM that shares the target's vocabulary (``speculative_model``); the built-in one is
**self-speculative** (Zhang et al. 2023, "Draft & Verify"; Elhoushi et al. 2024, "LayerSkip"): the target's
first ``num_layers`` decoder layers, then its final norm and LM head, with no extra weights.

**The draft's KV cache.** Its own paged cache (one tensor per draft layer, the target's block size and
number of blocks, its own free list and block tables), so the draft never reads or writes the target's.
Each sequence remembers the tokens whose K/V its draft cache holds (``fed``). Before proposing, the
longest common prefix of ``fed`` and the sequence's tokens is what stays valid: after a verification that
rejected drafts, the rejected positions fall outside it and are simply overwritten (rolled back); after
preemption (or for a new branch) the engine frees the draft's blocks and the draft recomputes the whole
context at its next proposal, as the target does. The first draft forward is thus one ragged extend over
every proposing sequence's not-yet-drafted tokens (usually the token the target added, plus the last
accepted draft); the next ``k - 1`` are one-token decodes.

Drafts of greedy lines are the draft's argmax (after the line's logits processors); drafts of sampled
lines are drawn from the draft's processed, temperature-scaled and truncated distribution ``q``
(``Sampler.probs``), which the rejection sampler needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from worker.engine.core.kv_cache_manager import cdiv
from worker.engine.core.request import Sequence
from worker.engine.executor.layers.attention import build_attention_metadata
from worker.engine.executor.models.llama import LlamaForCausalLM, head_size_of, num_kv_heads_of
from worker.engine.spec_decode.draft_sampling import DraftDrawer, chain_proposal
from worker.engine.spec_decode.proposer import DraftProposal, Proposer

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.executor.model_runner import ModelRunner


class SelfDraftModel(torch.nn.Module):
    """The target's first ``num_layers`` layers, its final norm and LM head (no weights of its own).

    Same call as the target model: ``forward(input_ids, positions, kv_caches, attn_metadata)`` with one
    KV cache per draft layer, then :meth:`compute_logits`.

    Raises:
        ValueError: ``num_layers`` outside ``1 .. target layers``, or a target whose forward is not
            Llama's embed -> layers -> norm (Gemma 3 scales its embeddings).
    """

    def __init__(self, target: LlamaForCausalLM, num_layers: int) -> None:
        super().__init__()
        num_target_layers = len(target.model.layers)
        if not 1 <= num_layers <= num_target_layers:
            raise ValueError(f"the self-draft needs 1..{num_target_layers} layers, got {num_layers}")
        if type(target).forward is not LlamaForCausalLM.forward:
            raise ValueError(f"{type(target).__name__} has its own forward; the self-draft needs Llama's layout")
        self.config = target.config
        self.target = target
        self.num_layers = num_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_metadata: Any
    ) -> torch.Tensor:
        """``[num_tokens]`` ids -> final-norm hidden states ``[num_tokens, hidden_size]`` after ``num_layers`` layers."""
        model = self.target.model
        hidden_states: torch.Tensor = model.embed_tokens(input_ids)
        for layer, kv_cache in zip(model.layers[: self.num_layers], kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        out: torch.Tensor = model.norm(hidden_states)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden_states)


@dataclass(slots=True)
class _DraftSeq:
    """A sequence's draft-cache state: its block table and the tokens whose K/V it holds, in order."""

    block_ids: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Drafts with ``model`` over its own paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        model: the draft (``forward`` as the target's, ``compute_logits``, ``config``), on the target's device.
        num_blocks, block_size: the draft cache's size (the target's, so it fits what the target fits).
        cost_per_token: one draft forward's cost relative to a target decode step.
        use_cpu_kernels, use_triton_kernels: the target's attention paths.
        eos_token_id: masked under ``min_tokens`` as for the target.
    """

    method = "draft"

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int,
        block_size: int,
        cost_per_token: float,
        use_cpu_kernels: bool,
        use_triton_kernels: bool,
        eos_token_id: int | None,
    ) -> None:
        self.model = model
        config: Any = model.config
        num_layers = getattr(model, "num_layers", None) or int(config.num_hidden_layers)
        num_kv_heads = num_kv_heads_of(config)
        self.num_queries_per_kv = int(config.num_attention_heads) // num_kv_heads
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(
                2, num_blocks, block_size, num_kv_heads, head_size_of(config), dtype=self.dtype, device=self.device
            )
            for _ in range(num_layers)
        ]
        self.cost_per_token = cost_per_token
        self.use_cpu_kernels = use_cpu_kernels
        self.use_triton_kernels = use_triton_kernels
        self.drawer = DraftDrawer(eos_token_id)
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _DraftSeq] = {}

    @classmethod
    def build(cls, config: EngineConfig, model_runner: ModelRunner) -> DraftModelProposer:
        """The draft ``config`` asks for: ``speculative_model``'s folder, else the target's first
        ``speculative_draft_num_layers`` layers (default a quarter of them, at least one).

        Raises:
            ValueError: a draft model whose vocabulary differs from the target's, or as :class:`SelfDraftModel`.
        """
        target = model_runner.model
        num_target_layers = len(target.model.layers)
        draft: Any
        if config.speculative_model is not None:
            from worker.engine.executor.model_loader import load_model

            draft = load_model(config.speculative_model, model_runner.dtype, model_runner.device)
            if int(draft.config.vocab_size) != int(target.config.vocab_size):
                raise ValueError(
                    f"the draft's vocabulary ({draft.config.vocab_size}) is not the target's ({target.config.vocab_size})"
                )
            draft_size = sum(p.numel() for p in draft.parameters())
            cost = draft_size / sum(p.numel() for p in target.parameters())
        else:
            num_layers = config.speculative_draft_num_layers or max(num_target_layers // 4, 1)
            draft = SelfDraftModel(target, num_layers)
            cost = num_layers / num_target_layers
        return cls(
            draft,
            num_blocks=model_runner.num_blocks,
            block_size=model_runner.block_size,
            cost_per_token=cost,
            use_cpu_kernels=model_runner.use_cpu_kernels,
            use_triton_kernels=model_runner.use_triton_kernels,
            eos_token_id=model_runner.eos_token_id,
        )

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def free(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.drawer.free(seq.seq_id)
            state = self._seqs.pop(seq.seq_id, None)
            if state is not None:
                self._free_blocks.extend(reversed(state.block_ids))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_spec_tokens: list[int]) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in seqs]
        active: list[int] = []  # indices into seqs that draft this step
        for i, (seq, k) in enumerate(zip(seqs, num_spec_tokens, strict=True)):
            state = self._seqs.setdefault(seq.seq_id, _DraftSeq())
            if self._reserve(state, seq.num_tokens + k - 1):
                active.append(i)
        if not active:
            return proposals
        # First forward: every token past the longest valid prefix of the draft cache.
        starts = []
        for i in active:
            state, token_ids = self._seqs[seqs[i].seq_id], seqs[i].token_ids
            valid = 0
            limit = min(len(state.fed), len(token_ids) - 1)
            while valid < limit and state.fed[valid] == token_ids[valid]:
                valid += 1
            starts.append(valid)
            del state.fed[valid:]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        inputs = [seqs[i].token_ids[start:] for i, start in zip(active, starts, strict=True)]
        step_seqs = active
        for j in range(max(num_spec_tokens[i] for i in active)):
            step_seqs = [i for i in step_seqs if num_spec_tokens[i] > j]
            if j > 0:
                inputs = [[drafts[i][-1]] for i in step_seqs]
            logits = self._forward(seqs, step_seqs, inputs)
            self._draw(seqs, step_seqs, logits, drafts, probs)
        for i in active:
            proposals[i] = chain_proposal(seqs[i], drafts[i], probs[i])
        return proposals

    def _reserve(self, state: _DraftSeq, num_positions: int) -> bool:
        """Grow ``state``'s block table to hold ``num_positions`` tokens; False (unchanged) if the pool is short."""
        num_needed = cdiv(num_positions, self.block_size) - len(state.block_ids)
        if num_needed > len(self._free_blocks):
            return False
        for _ in range(num_needed):
            state.block_ids.append(self._free_blocks.popleft())
        return True

    def _forward(self, seqs: list[Sequence], step_seqs: list[int], inputs: list[list[int]]) -> torch.Tensor:
        """Run the draft over ``inputs[n]`` (appended to ``seqs[step_seqs[n]]``'s fed tokens); the float32 logits
        of each sequence's last input ``[len(step_seqs), vocab_size]``."""
        query_lens, seq_lens, tables, input_ids = [], [], [], []
        for i, tokens in zip(step_seqs, inputs, strict=True):
            state = self._seqs[seqs[i].seq_id]
            query_lens.append(len(tokens))
            state.fed.extend(tokens)
            seq_lens.append(len(state.fed))
            tables.append(state.block_ids)
            input_ids.extend(tokens)
        metadata = build_attention_metadata(
            query_lens,
            seq_lens,
            tables,
            self.block_size,
            num_queries_per_kv=self.num_queries_per_kv,
            dtype=self.dtype,
            use_cpu_kernels=self.use_cpu_kernels,
            use_triton_kernels=self.use_triton_kernels,
            device=self.device,
        )
        hidden_states = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device), metadata.positions, self.kv_caches, metadata
        )
        last_rows = torch.tensor(
            [sum(query_lens[: n + 1]) - 1 for n in range(len(query_lens))], dtype=torch.long, device=self.device
        )
        logits: torch.Tensor = self.model.compute_logits(hidden_states.index_select(0, last_rows))
        return logits

    def _draw(
        self,
        seqs: list[Sequence],
        step_seqs: list[int],
        logits: torch.Tensor,
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """Append one draft per sequence (:class:`DraftDrawer`), keeping ``q`` in ``probs``."""
        tokens, q = self.drawer.draw([seqs[i] for i in step_seqs], logits, [drafts[i] for i in step_seqs])
        for row, i in enumerate(step_seqs):
            drafts[i].append(tokens[row])
            probs[i].append(q[row])
