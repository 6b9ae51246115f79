"""The model runner: owns the model and the paged KV cache, turns a SchedulerOutput into sampled tokens.

As vLLM's ``GPUModelRunner``: all scheduled tokens of all sequences become one flat ragged batch (no
padding), sequence by sequence in the scheduler's order; K/V are written through ``slot_mapping``;
logits are computed only for rows where a token is sampled (the last token of a sequence that reaches
the end of its known tokens this step: a finished prefill or a decode) and, for requests asking for
prompt logprobs, at their prompt positions. A sequence with draft tokens (``spec_token_ids``) is one
extend of ``k + 1`` positions in the same batch; its ``k + 1`` rows go to the rejection sampler. Drafts that
form a tree (``spec_parent_idx``) take the same ``k + 1`` slots, attend through a tree mask at depth-based
positions, and the accepted path's K/V are then moved to the sequence's consecutive slots. The batch
is built with NumPy over per-sequence arrays, so the Python work per step grows with the number of
sequences, not of tokens.

A proposer that drafts from the target's features (EAGLE, Medusa) sets :attr:`ModelRunner.hidden_states_sink`:
after each step it receives the final-norm hidden states of every row the step computed (the features the
LM head reads, as EAGLE's and Medusa's training data take them from Hugging Face models), with a verified
tree's accepted nodes' rows moved to the rows right after the last token's, as their K/V are; without one
nothing is kept.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from itertools import accumulate

import psutil  # type: ignore[import-untyped]
import torch

from worker.engine.config import EngineConfig
from worker.engine.core.request import Sequence
from worker.engine.core.scheduler import SchedulerOutput
from worker.engine.executor.forward_context import batch_invariant_step
from worker.engine.executor.kv_calibration import SMOOTHED_KV_CACHE_DTYPES, calibrate_key_smoothing
from worker.engine.executor.layers.attention import (
    KVCache,
    QuantizedKVCache,
    build_attention_metadata,
    copy_slots,
    cpu_kernels_apply,
    triton_kernels_apply,
)
from worker.engine.executor.layers.attention.kv_cache import kv_cache_bytes_per_token_head
from worker.engine.executor.layers.attention.tree import tree_path
from worker.engine.executor.model_loader import load_model
from worker.engine.executor.models.llama import head_size_of, long_rope_positions, num_kv_heads_of
from worker.engine.sample.metadata import SamplerOutput, SamplingMetadata
from worker.engine.sample.rejection_sampler import RejectionSampler, VerifiedTokens
from worker.engine.sample.sampler import Sampler, compute_prompt_logprobs, make_sampling_key

PromptLogprobEntry = tuple[float, list[tuple[int, float]]]
HiddenStatesSink = Callable[[list[Sequence], list[int], list[int], torch.Tensor], None]


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs computed this step for ``seq``: ``entries[j]`` scores prompt token ``first_position + j``."""

    seq: Sequence
    first_position: int
    entries: list[PromptLogprobEntry]


@dataclass(slots=True)
class ModelRunnerOutput:
    """Result of one forward pass: ``sampled_seqs[i]`` got row ``i`` of ``sampler_output`` (branches forked
    this step follow the sequences sampled from their own logits).

    ``prompt_logprobs`` holds the prompt logprobs computed this step. Beam-search sequences are not
    sampled: ``beam_seqs[i]`` reports ``beam_candidates[i]``, its ``2 * n`` most likely next tokens as
    ``(token_id, raw logprob)``, best first. Sequences that verified drafts are not in ``sampled_seqs``:
    ``verified_seqs[i]`` got ``verified[i]``. ``forward_s`` is wall time in the model forward and logits,
    ``sampling_s`` in the sampler, the rejection sampler and prompt logprobs, ``grammar_s`` in filling
    structured-output bitmasks (seconds).
    """

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput | None
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    beam_seqs: list[Sequence] = field(default_factory=list)
    beam_candidates: list[list[tuple[int, float]]] = field(default_factory=list)
    verified_seqs: list[Sequence] = field(default_factory=list)
    verified: list[VerifiedTokens] = field(default_factory=list)
    forward_s: float = 0.0
    sampling_s: float = 0.0
    grammar_s: float = 0.0


def kv_cache_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one block takes across all layers, K and V: ``2 * layers * block_size * kv_heads * head_size * itemsize``
    in the compute ``dtype``; quantized, one byte per element plus a float32 scale per (token, KV head, group of 32
    channels) (:func:`~worker.engine.executor.layers.attention.kv_cache.kv_cache_bytes_per_token_head`)."""
    per_token_head = kv_cache_bytes_per_token_head(kv_cache_dtype, head_size, dtype)
    return 2 * num_layers * block_size * num_kv_heads * per_token_head


def copy_blocks(
    kv_caches: SequenceT[KVCache], blocks_to_copy: SequenceT[tuple[int, int]], *, use_triton_kernels: bool = False
) -> None:
    """Execute copy-on-write block copies in every layer's cache: block ``dst`` becomes block ``src``.

    Args:
        kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor per layer, or one
            :class:`QuantizedKVCache` (its scales are copied with its elements); mutated.
        blocks_to_copy: ``(src, dst)`` physical block ids; every ``dst`` distinct. All copies read the
            caches as they were before the call (one gather, then one ``index_copy_`` per layer), as
            vLLM's ``copy_blocks`` (Kwon et al. 2023, section 4.4).
        use_triton_kernels: copy with one Triton launch per layer (CUDA) when no destination is also a
            source (the launch copies all pairs at once); otherwise the gather-then-scatter above.
    """
    if not blocks_to_copy:
        return
    device = kv_caches[0].data.device if isinstance(kv_caches[0], QuantizedKVCache) else kv_caches[0].device
    src_ids = [s for s, _ in blocks_to_copy]
    dst_ids = [d for _, d in blocks_to_copy]
    src = torch.tensor(src_ids, dtype=torch.long, device=device)
    dst = torch.tensor(dst_ids, dtype=torch.long, device=device)
    if use_triton_kernels and set(src_ids).isdisjoint(dst_ids):
        from kernels.triton_attention import copy_blocks_triton  # NOTE: here so CPU engines never import triton

        for kv_cache in kv_caches:
            if isinstance(kv_cache, QuantizedKVCache):
                copy_blocks_triton(kv_cache.data, src, dst)
                copy_blocks_triton(kv_cache.scales, src, dst)
            else:
                copy_blocks_triton(kv_cache, src, dst)
        return
    for kv_cache in kv_caches:
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.copy_blocks(src, dst)
        else:
            kv_cache.index_copy_(1, dst, kv_cache.index_select(1, src))


def _top_candidates(
    logits: torch.Tensor, num_top: list[int], grammar_masks: GrammarMasks | None = None
) -> list[list[tuple[int, float]]]:
    """Per row the ``num_top[i]`` largest ``log_softmax`` entries of float32 ``logits: [R, vocab_size]`` as
    ``(token_id, logprob)``, best first (a beam's expansion, as Hugging Face's beam search scores it). Rows under
    a grammar offer only tokens it allows, with their raw logprobs (HF's logits processors on the log-softmax)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if grammar_masks is not None:
        grammar_masks.apply(logprobs)
    top = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    ids: list[list[int]] = top.indices.tolist()
    values: list[list[float]] = top.values.tolist()
    return [
        [(token_id, value) for token_id, value in zip(i[:k], v[:k], strict=True) if value != -math.inf]
        for i, v, k in zip(ids, values, num_top, strict=True)
    ]


@dataclass(slots=True)
class GrammarMasks:
    """The structured-output bitmask of a group of logits rows: ``bitmask`` (int32 ``[num_rows, ceil(vocab_size /
    32)]``, row ``i`` for logits row ``i``) and the ``rows`` under a grammar (docs/engine.md, "Structured outputs")."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows to ``-inf`` (``logits: [num_rows, vocab_size]``, mutated)."""
        from worker.engine.structured_output.backend_xgrammar import apply_token_bitmask

        apply_token_bitmask(logits, self.bitmask, self.rows)

    def select(self, rows: list[int]) -> GrammarMasks | None:
        """The masks of ``rows`` (renumbered from 0), or None when none of them is constrained."""
        constrained = set(self.rows)
        kept = [j for j, row in enumerate(rows) if row in constrained]
        if not kept:
            return None
        return GrammarMasks(self.bitmask[torch.tensor(rows, dtype=torch.long)], kept)


def fill_grammar_masks(
    seqs: list[Sequence], vocab_size: int, draft_token_ids: list[list[int]] | None = None
) -> GrammarMasks | None:
    """The bitmask of one row per sequence, or ``1 + len(draft_token_ids[i])`` rows (the positions a speculating
    sequence verifies); None when no sequence is constrained (nothing is allocated)."""
    if all(seq.grammar is None for seq in seqs):
        return None
    from worker.engine.structured_output.backend_xgrammar import allocate_token_bitmask

    num_rows = [1 + len(drafts) for drafts in draft_token_ids] if draft_token_ids is not None else [1] * len(seqs)
    bitmask = allocate_token_bitmask(sum(num_rows), vocab_size)
    rows: list[int] = []
    first_row = 0
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            seq.grammar.fill_bitmask(bitmask, first_row, draft_token_ids[i] if draft_token_ids is not None else ())
            rows.extend(range(first_row, first_row + num_rows[i]))
        first_row += num_rows[i]
    return GrammarMasks(bitmask, rows)


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` -> the torch dtype. Raises ValueError on anything else."""
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on CPU, memory the kernel zeroes page by page as it is
    first touched (a private anonymous mapping), so a KV cache costs nothing at start for the blocks no job has used
    yet (``torch.zeros`` writes every byte: about 0.6 CPU-s per GiB at each worker start). Page-aligned, contiguous.
    :func:`populate` touches every page up front where a process wants no faults while it runs."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # NOTE: private, not mmap's default MAP_SHARED (shared memory: slower faults, and shared with a forked child).
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: the tensor holds the mapping (torch.frombuffer keeps a reference to its buffer) and frees it with the tensor.
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def check_kv_cache_fits(num_bytes: int) -> None:
    """Refuse a CPU KV cache of ``num_bytes`` larger than the memory the machine has available now
    (``psutil.virtual_memory().available``): such a cache would fail to map, or be killed by the kernel's OOM killer
    when it is faulted in (docs/engine.md, "KV cache memory"), instead of failing at start with a setting to change.

    Raises:
        ValueError: naming the bytes needed and available and ``kv_cache_memory_bytes``.
    """
    available = psutil.virtual_memory().available
    if num_bytes > available:
        raise ValueError(
            f"the KV cache needs {num_bytes} bytes but this machine has {available} bytes of memory available: "
            "lower kv_cache_memory_bytes (BATCHINFER_KV_CACHE_MEMORY_BYTES)"
        )


_MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14); Python's mmap module names it from 3.13 only


def populate(tensor: torch.Tensor) -> None:
    """Fault in every page of a contiguous CPU ``tensor`` now, as writable and without changing its values.

    A KV cache from :func:`zeros_on_first_touch` otherwise takes one page fault per 4 KiB the first time a block is
    written, inside the steps of the first jobs: 73,000 faults, about 5% of the wall time of issue #27's mixed
    workload on a fresh engine (docs/engine.md, "KV cache memory"). ``madvise(MADV_POPULATE_WRITE)`` faults the
    range in the kernel; where that is refused (a kernel before 5.14) each page gets one zero byte written
    (the pages hold zeros, so the values stay). Costs about 0.3-2 s per GiB, once.

    Raises:
        OSError: the kernel could not provide the pages (``ENOMEM``).
    """
    num_bytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or num_bytes == 0:
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + num_bytes - start
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0:
        return
    error = ctypes.get_errno()
    if error != errno.EINVAL:  # EINVAL: a kernel without MADV_POPULATE_WRITE; anything else (ENOMEM) is real
        raise OSError(error, f"faulting in {length} bytes of KV cache: {os.strerror(error)}")
    flat = tensor.view(torch.uint8).view(-1)
    first = (-tensor.data_ptr()) % page  # the first page boundary inside the tensor
    flat[first::page] = flat[first::page].clone()  # NOTE: a copy_ from itself would be skipped as a no-op
    flat[:1] = flat[:1].clone()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class ModelRunner:
    """Loads the model, allocates ``num_blocks`` KV blocks per layer and executes scheduled steps.

    Raises:
        ValueError: on an unknown dtype, or a KV cache budget smaller than one block.
    """

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.block_size
        self.eos_token_id = eos_token_id
        self.model = load_model(
            config.model, self.dtype, self.device, config.quantization, prepared_dir=config.prepared_weights_dir
        )
        model_config = self.model.config
        num_layers = int(model_config.num_hidden_layers)
        num_kv_heads = num_kv_heads_of(model_config)
        head_size = head_size_of(model_config)
        self.num_queries_per_kv = int(model_config.num_attention_heads) // num_kv_heads
        # NOTE: the int4 cache has no kernel yet: every row then attends gathered, dequantized blocks.
        kernel_cache = config.kv_cache_dtype != "int4"
        self.use_cpu_kernels = kernel_cache and cpu_kernels_apply(self.device, self.dtype)
        self.use_triton_kernels = kernel_cache and triton_kernels_apply(self.device)
        self.sliding_window = self.model.sliding_window
        self.long_rope_original_max = self.model.long_rope_original_max
        self.kv_cache_dtype = config.kv_cache_dtype
        bytes_per_block = kv_cache_bytes_per_block(
            num_layers, self.block_size, num_kv_heads, head_size, self.dtype, self.kv_cache_dtype
        )
        self.bytes_per_block = bytes_per_block
        self.num_blocks = config.num_gpu_blocks_override or config.kv_cache_memory_bytes // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is less than one KV block ({bytes_per_block} bytes)"
            )
        if self.device.type == "cpu":
            check_kv_cache_fits(self.num_blocks * bytes_per_block)
        # NOTE: zeros, not empty: attention gathers whole blocks and masks, and 0 * NaN would poison a row.
        self.kv_caches: list[KVCache]
        if self.kv_cache_dtype == "auto":
            self.kv_caches = [
                zeros_on_first_touch(
                    (2, self.num_blocks, self.block_size, num_kv_heads, head_size), self.dtype, self.device
                )
                for _ in range(num_layers)
            ]
        else:
            key_smoothing: SequenceT[torch.Tensor | None] = [None] * num_layers
            if self.kv_cache_dtype in SMOOTHED_KV_CACHE_DTYPES:
                key_smoothing = calibrate_key_smoothing(
                    self.model,
                    vocab_size=int(model_config.vocab_size),
                    num_layers=num_layers,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    num_queries_per_kv=self.num_queries_per_kv,
                    sliding_window=self.sliding_window,
                    dtype=self.dtype,
                    device=self.device,
                    use_cpu_kernels=self.use_cpu_kernels,
                    use_triton_kernels=self.use_triton_kernels,
                )
            self.kv_caches = [
                QuantizedKVCache.zeros(
                    self.kv_cache_dtype,
                    self.num_blocks,
                    self.block_size,
                    num_kv_heads,
                    head_size,
                    self.device,
                    key_smoothing=smoothing,
                )
                for smoothing in key_smoothing
            ]
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self._sampling_keys: dict[int, int] = {}
        # Called as sink(seqs, num_computed_tokens, num_scheduled_tokens, hidden_states) after each forward:
        # hidden_states is [num_tokens, hidden_size] (model dtype), seqs[i]'s rows at its positions
        # num_computed_tokens[i] .. + num_scheduled_tokens[i] - 1 (drafts included), sequence by sequence.
        self.hidden_states_sink: HiddenStatesSink | None = None

    def populate_kv_cache(self) -> None:
        """Fault in the whole KV cache now (:func:`populate`), so the jobs that first fill it take no page faults.
        A quantized cache's arrays are already written at start (``torch.zeros``)."""
        for cache in self.kv_caches:
            if isinstance(cache, torch.Tensor):
                populate(cache)

    def free_seqs(self, seqs: list[Sequence]) -> None:
        """Forget per-sequence state (sampling keys) of finished or aborted sequences."""
        for seq in seqs:
            self._sampling_keys.pop(seq.seq_id, None)

    def _sampling_key(self, seq: Sequence) -> int:
        if seq.params.is_greedy:
            return 0
        key = self._sampling_keys.get(seq.seq_id)
        if key is None:
            key = self._sampling_keys[seq.seq_id] = make_sampling_key(
                seq.params.seed, seq.sample_index, seq.prompt_token_ids
            )
        return key

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, then sample where a sequence reaches its end.

        Args:
            scheduler_output: sequences (batch order) and their scheduled token counts; each sequence's
                ``num_computed_tokens`` is still the count before this step. A sequence with
                ``spec_token_ids`` is scheduled for its last token plus those drafts.
            block_ids: each scheduled sequence's block table (physical block ids), covering its
                computed plus scheduled tokens.
            draft_probs: by ``seq_id``, the distributions drafts were drawn from (float32
                ``[k, vocab_size]``); a speculating sequence absent here has one-hot drafts.

        Returns:
            the sampled sequences with their tokens and logprobs, plus any prompt logprobs.
        """
        seqs = scheduler_output.seqs
        query_lens_list = scheduler_output.num_scheduled_tokens
        num_computed_list = [seq.num_computed_tokens for seq in seqs]
        seq_lens_list = [n + q for n, q in zip(num_computed_list, query_lens_list)]
        batch_invariant = [seq.params.batch_invariant for seq in seqs]
        attn_metadata = build_attention_metadata(
            query_lens_list,
            seq_lens_list,
            block_ids,
            self.block_size,
            num_queries_per_kv=self.num_queries_per_kv,
            dtype=self.dtype,
            use_cpu_kernels=self.use_cpu_kernels,
            use_triton_kernels=self.use_triton_kernels,
            batch_invariant=batch_invariant,
            device=self.device,
            sliding_window=self.sliding_window,
            tree_parents=(
                [seq.spec_parent_idx for seq in seqs] if any(seq.spec_parent_idx is not None for seq in seqs) else None
            ),
        )
        if attn_metadata.num_tokens == len(seqs):  # pure decode: one token per sequence, its last one
            input_ids = [seq.token_ids[-1] for seq in seqs]
        else:
            input_ids = []
            for seq, start, query_len in zip(seqs, num_computed_list, query_lens_list):
                input_ids.extend(seq.token_ids[start : start + query_len])
                input_ids.extend(seq.spec_token_ids)

        cu_query_lens = list(accumulate(query_lens_list, initial=0))
        sampled_seqs = [seq for seq, seq_len in zip(seqs, seq_lens_list) if seq_len == seq.num_tokens]
        logits_rows = [cu_query_lens[i + 1] - 1 for i, seq in enumerate(seqs) if seq_lens_list[i] == seq.num_tokens]
        # Branches forked off a sequence this step sample from its logits row (sample_rows indexes logits).
        sample_rows = list(range(len(sampled_seqs)))
        if scheduler_output.forks:
            children_of = {id(parent): children for parent, children in scheduler_output.forks}
            for row, seq in enumerate(list(sampled_seqs)):
                children = children_of.get(id(seq), [])
                sampled_seqs.extend(children)
                sample_rows.extend([row] * len(children))
        prompt_rows, prompt_chunks = self._prompt_logprob_rows(seqs, num_computed_list, query_lens_list, cu_query_lens)
        # Verification: every position of a speculating sequence is scored (its last token and each draft).
        verified_seqs = [seq for seq in seqs if seq.spec_token_ids]
        verify_rows = [
            row
            for i, seq in enumerate(seqs)
            if seq.spec_token_ids
            for row in range(cu_query_lens[i], cu_query_lens[i + 1])
        ]

        device = self.device
        start_s = time.perf_counter()
        copy_blocks(self.kv_caches, scheduler_output.blocks_to_copy, use_triton_kernels=self.use_triton_kernels)
        rows = logits_rows + [row for rows_of_seq in prompt_rows for row in rows_of_seq] + verify_rows
        # A step holding a batch-invariant sequence runs every layer on its height-independent numerics, the LM head
        # (which verification's rows also go through) included (forward_context).
        with batch_invariant_step(any(batch_invariant)):
            hidden_states = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=device),
                self._rope_positions(seqs, query_lens_list, attn_metadata.positions),
                self.kv_caches,
                attn_metadata,
            )
            if not rows:  # only prefill chunks that sample nothing yet
                if self.hidden_states_sink is not None:
                    self.hidden_states_sink(seqs, num_computed_list, query_lens_list, hidden_states)
                self._synchronize()
                return ModelRunnerOutput([], None, [], forward_s=time.perf_counter() - start_s)
            logits = self.model.compute_logits(hidden_states[torch.tensor(rows, dtype=torch.long, device=device)])
        # NOTE: the matchers fill their bitmasks on the CPU while a device still computes the logits.
        grammar_start_s = time.perf_counter()
        vocab_size = logits.shape[-1]
        sample_masks = fill_grammar_masks(sampled_seqs, vocab_size)
        verify_masks = fill_grammar_masks(verified_seqs, vocab_size, [seq.spec_token_ids for seq in verified_seqs])
        grammar_s = time.perf_counter() - grammar_start_s
        self._synchronize()
        sampling_start_s = time.perf_counter()

        beam_seqs: list[Sequence] = []
        beam_candidates: list[list[tuple[int, float]]] = []
        if any(seq.params.use_beam_search for seq in sampled_seqs):
            beam_idx = [i for i, seq in enumerate(sampled_seqs) if seq.params.use_beam_search]
            beam_seqs = [sampled_seqs[i] for i in beam_idx]
            beam_logits = logits.index_select(0, torch.tensor([sample_rows[i] for i in beam_idx], device=device))
            beam_masks = sample_masks.select(beam_idx) if sample_masks is not None else None
            beam_candidates = _top_candidates(beam_logits, [2 * seq.params.n for seq in beam_seqs], beam_masks)
            kept = [i for i, seq in enumerate(sampled_seqs) if not seq.params.use_beam_search]
            sampled_seqs = [sampled_seqs[i] for i in kept]
            sample_rows = [sample_rows[i] for i in kept]
            if sample_masks is not None:
                sample_masks = sample_masks.select(kept)

        sampler_output = None
        if sampled_seqs:
            metadata = SamplingMetadata(
                params=[seq.params for seq in sampled_seqs],
                sampling_keys=[self._sampling_key(seq) for seq in sampled_seqs],
                prompt_token_ids=[seq.prompt_token_ids for seq in sampled_seqs],
                output_token_ids=[seq.output_token_ids for seq in sampled_seqs],
                eos_token_id=self.eos_token_id,
            )
            if sample_masks is not None:
                metadata.token_bitmask, metadata.constrained_rows = sample_masks.bitmask, sample_masks.rows
            if sample_rows == list(range(len(logits_rows))):
                sample_logits = logits[: len(logits_rows)]
            else:
                sample_logits = logits.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=device))
            sampler_output = self.sampler(sample_logits, metadata)

        prompt_logprobs: list[PromptLogprobsChunk] = []
        offset = len(logits_rows)
        for (seq, first_position), rows_of_seq in zip(prompt_chunks, prompt_rows):
            seq_logits = logits[offset : offset + len(rows_of_seq)]
            offset += len(rows_of_seq)
            targets = seq.prompt_token_ids[first_position : first_position + len(rows_of_seq)]
            entries = compute_prompt_logprobs(seq_logits, targets, seq.params.prompt_logprobs or 0)
            prompt_logprobs.append(PromptLogprobsChunk(seq, first_position, entries))
        verified: list[VerifiedTokens] = []
        if verified_seqs:
            verified = self._verify(logits[offset:], verified_seqs, draft_probs or {}, verify_masks)
            self._keep_accepted_paths(seqs, block_ids, verified_seqs, verified)
        if self.hidden_states_sink is not None:
            _move_accepted_rows(hidden_states, seqs, cu_query_lens, verified_seqs, verified)
            self.hidden_states_sink(seqs, num_computed_list, query_lens_list, hidden_states)
        self._synchronize()
        return ModelRunnerOutput(
            sampled_seqs,
            sampler_output,
            prompt_logprobs,
            beam_seqs,
            beam_candidates,
            verified_seqs,
            verified,
            forward_s=sampling_start_s - start_s - grammar_s,
            sampling_s=time.perf_counter() - sampling_start_s,
            grammar_s=grammar_s,
        )

    def _verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        draft_probs: dict[int, torch.Tensor],
        grammar_masks: GrammarMasks | None,
    ) -> list[VerifiedTokens]:
        """Rejection-sample each sequence's drafts from its ``k + 1`` rows of ``logits`` (in order).

        Row ``j`` of a sequence sees the output so far plus its first ``j`` drafts, so penalties, min-tokens and
        a grammar's bitmask apply at every verified position as they would one token at a time.
        """
        params, keys, prompts, outputs = [], [], [], []
        for seq in seqs:
            key = self._sampling_key(seq)
            drafts, parents = seq.spec_token_ids, seq.spec_parent_idx
            for j in range(len(drafts) + 1):
                params.append(seq.params)
                keys.append(key)
                prompts.append(seq.prompt_token_ids)
                if not j:
                    outputs.append(seq.output_token_ids)
                elif parents is None:
                    outputs.append(seq.output_token_ids + drafts[:j])
                else:  # a tree's row j follows the path to node j - 1
                    outputs.append(seq.output_token_ids + [drafts[node] for node in tree_path(parents, j - 1)])
        metadata = SamplingMetadata(params, keys, prompts, outputs, self.eos_token_id)
        if grammar_masks is not None:
            metadata.token_bitmask, metadata.constrained_rows = grammar_masks.bitmask, grammar_masks.rows
        return self.rejection_sampler(
            logits,
            metadata,
            [seq.spec_token_ids for seq in seqs],
            [draft_probs.get(seq.seq_id) for seq in seqs],
            [seq.spec_parent_idx for seq in seqs],
        )

    def _keep_accepted_paths(
        self,
        seqs: list[Sequence],
        block_ids: list[list[int]],
        verified_seqs: list[Sequence],
        verified: list[VerifiedTokens],
    ) -> None:
        """Move each verified tree's accepted nodes to the slots right after the last token (node ``i`` was
        written at the ``i``-th slot after it), so the cache holds what plain decoding would have written; the
        slots after the path are rolled back by the scheduler like rejected chain drafts."""
        table_of = {id(seq): table for seq, table in zip(seqs, block_ids)}
        src: list[int] = []
        dst: list[int] = []
        for seq, result in zip(verified_seqs, verified):
            first = seq.num_computed_tokens + 1  # the first draft's position (the last token is not counted yet)
            table = table_of[id(seq)]
            for depth, node in enumerate(result.accepted_nodes):
                if node != depth:
                    for position, slots in ((first + node, src), (first + depth, dst)):
                        slots.append(table[position // self.block_size] * self.block_size + position % self.block_size)
        if not src:
            return
        # NOTE: nodes precede their children, so no destination is a source read later; copy_slots reads first anyway.
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for kv_cache in self.kv_caches:
            copy_slots(kv_cache, src_t, dst_t)

    def _rope_positions(self, seqs: list[Sequence], query_lens: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The positions the model's rotary tables are read at: ``positions`` itself, except under ``longrope``
        scaling, where each token's row also depends on its sequence's length (:func:`long_rope_positions`)."""
        original_max = self.long_rope_original_max
        if original_max is None:
            return positions
        seq_lens = torch.tensor([seq.num_tokens for seq in seqs], dtype=torch.long, device=self.device)
        per_token = seq_lens.repeat_interleave(torch.tensor(query_lens, device=self.device))
        offset = int(self.model.config.max_position_embeddings)
        return long_rope_positions(positions, per_token, original_max, offset)

    def _synchronize(self) -> None:
        """Wait for queued device work, so the wall times above are the work's (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _prompt_logprob_rows(
        seqs: list[Sequence], num_computed: list[int], query_lens: list[int], cu_query_lens: list[int]
    ) -> tuple[list[list[int]], list[tuple[Sequence, int]]]:
        """Batch rows whose logits score a prompt token, per sequence that asked for prompt logprobs.

        Row of position ``p`` predicts prompt token ``p + 1``; only sample 0 of a request reports them.
        Returns the rows and, per sequence, ``(seq, first prompt position scored)``.
        """
        rows: list[list[int]] = []
        chunks: list[tuple[Sequence, int]] = []
        for i, seq in enumerate(seqs):
            if seq.params.prompt_logprobs is None or seq.sample_index != 0:
                continue
            start = num_computed[i]
            end = min(start + query_lens[i], seq.num_prompt_tokens - 1)
            if start >= end:
                continue
            first_row = cu_query_lens[i]
            rows.append(list(range(first_row, first_row + end - start)))
            chunks.append((seq, start + 1))
        return rows, chunks


def _move_accepted_rows(
    hidden_states: torch.Tensor,
    seqs: list[Sequence],
    cu_query_lens: list[int],
    verified_seqs: list[Sequence],
    verified: list[VerifiedTokens],
) -> None:
    """Move each verified tree's accepted nodes' rows of ``hidden_states`` (``[rows, hidden]``, in place) to the rows
    right after its last token's, in path order (``_keep_accepted_paths``' moves), so a sequence's rows are those
    of the positions it now holds, as a chain's are; the rows after the path are stale like rejected drafts'."""
    first_row = {id(seq): cu_query_lens[i] + 1 for i, seq in enumerate(seqs)}
    src: list[int] = []
    dst: list[int] = []
    for seq, result in zip(verified_seqs, verified, strict=True):
        for depth, node in enumerate(result.accepted_nodes):
            if node != depth:
                src.append(first_row[id(seq)] + node)
                dst.append(first_row[id(seq)] + depth)
    if src:
        device = hidden_states.device
        moved = hidden_states[torch.tensor(src, dtype=torch.long, device=device)]
        hidden_states[torch.tensor(dst, dtype=torch.long, device=device)] = moved
