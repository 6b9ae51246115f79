"""The model runner: owns the model and the paged KV cache, turns a SchedulerOutput into sampled tokens.

As vLLM's ``GPUModelRunner``: all scheduled tokens of all sequences become one flat ragged batch (no
padding), sequence by sequence in the scheduler's order; K/V are written through ``slot_mapping``;
logits are computed only for rows where a token is sampled (the last token of a sequence that reaches
the end of its known tokens this step: a finished prefill or a decode) and, for requests asking for
prompt logprobs, at their prompt positions. The batch is built with NumPy over per-sequence arrays, so
the Python work per step grows with the number of sequences, not of tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.engine.executor.layers.attention.paged import AttentionMetadata
from worker.engine.config import EngineConfig
from worker.engine.executor.model_loader import load_model
from worker.engine.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_prompt_logprobs, make_generator
from worker.engine.core.scheduler import SchedulerOutput
from worker.engine.core.request import Sequence

PromptLogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs computed this step for ``seq``: ``entries[j]`` scores prompt token ``first_position + j``."""

    seq: Sequence
    first_position: int
    entries: list[PromptLogprobEntry]


@dataclass(slots=True)
class ModelRunnerOutput:
    """Result of one forward pass: ``sampled_seqs[i]`` got row ``i`` of ``sampler_output``.

    ``prompt_logprobs`` holds the prompt logprobs computed this step. ``model_forward_s`` is
    wall time in the model forward, logits and sampler (seconds).
    """

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput | None
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    model_forward_s: float = 0.0


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V: ``2 * layers * block_size * kv_heads * head_size * itemsize``."""
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` -> the torch dtype. Raises ValueError on anything else."""
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


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
        self.model = load_model(config.model, self.dtype, self.device)
        model_config = self.model.config
        num_layers = model_config.num_hidden_layers
        num_kv_heads = model_config.num_key_value_heads
        head_size = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        bytes_per_block = kv_cache_bytes_per_block(num_layers, self.block_size, num_kv_heads, head_size, self.dtype)
        self.num_blocks = config.num_gpu_blocks_override or config.kv_cache_memory_bytes // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is less than one KV block ({bytes_per_block} bytes)"
            )
        # NOTE: zeros, not empty: attention gathers whole blocks and masks, and 0 * NaN would poison a row.
        self.kv_caches = [
            torch.zeros(2, self.num_blocks, self.block_size, num_kv_heads, head_size, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}

    def free_seqs(self, seqs: list[Sequence]) -> None:
        """Forget per-sequence state (generators) of finished or aborted sequences."""
        for seq in seqs:
            self._generators.pop(seq.seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.is_greedy:
            return None
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = self._generators[seq.seq_id] = make_generator(seq.params.seed, seq.sample_index, self.device)
        return generator

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, then sample where a sequence reaches its end.

        Args:
            scheduler_output: sequences (batch order) and their scheduled token counts; each sequence's
                ``num_computed_tokens`` is still the count before this step.
            block_ids: each scheduled sequence's block table (physical block ids), covering its
                computed plus scheduled tokens.

        Returns:
            the sampled sequences with their tokens and logprobs, plus any prompt logprobs.
        """
        seqs = scheduler_output.seqs
        num_seqs = len(seqs)
        block_size = self.block_size
        query_lens_list = scheduler_output.num_scheduled_tokens
        num_computed_list = [seq.num_computed_tokens for seq in seqs]
        query_lens = np.array(query_lens_list, dtype=np.int64)
        num_computed = np.array(num_computed_list, dtype=np.int64)
        seq_lens = num_computed + query_lens
        cu_query_lens = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_query_lens[1:])
        num_tokens = int(cu_query_lens[-1])

        if num_tokens == num_seqs:  # pure decode: one token per sequence, its last one
            input_ids = [seq.token_ids[-1] for seq in seqs]
            positions = num_computed
        else:
            input_ids = []
            for seq, start, query_len in zip(seqs, num_computed_list, query_lens_list):
                input_ids.extend(seq.token_ids[start : start + query_len])
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_query_lens[:-1] - num_computed, query_lens)

        max_num_blocks = max(len(ids) for ids in block_ids)
        block_tables = np.zeros((num_seqs, max_num_blocks), dtype=np.int32)
        for row, ids in enumerate(block_ids):
            block_tables[row, : len(ids)] = ids
        token_seq_idx = np.repeat(np.arange(num_seqs), query_lens)
        slot_mapping = block_tables[token_seq_idx, positions // block_size].astype(np.int64) * block_size + (
            positions % block_size
        )

        seq_lens_list = seq_lens.tolist()
        sampled_seqs = [seq for seq, seq_len in zip(seqs, seq_lens_list) if seq_len == seq.num_tokens]
        logits_rows = [int(cu_query_lens[i + 1]) - 1 for i, seq in enumerate(seqs) if seq_lens_list[i] == seq.num_tokens]
        prompt_rows, prompt_chunks = self._prompt_logprob_rows(seqs, num_computed_list, query_lens_list, cu_query_lens)

        device = self.device
        attn_metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(cu_query_lens.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            query_lens_list=list(query_lens_list),
            seq_lens_list=seq_lens_list,
        )
        start_s = time.perf_counter()
        hidden_states = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.from_numpy(np.ascontiguousarray(positions)).to(device),
            self.kv_caches,
            attn_metadata,
        )
        rows = logits_rows + [row for rows_of_seq in prompt_rows for row in rows_of_seq]
        if not rows:  # only prefill chunks that sample nothing yet
            return ModelRunnerOutput([], None, [], time.perf_counter() - start_s)
        logits = self.model.compute_logits(hidden_states[torch.tensor(rows, dtype=torch.long, device=device)])

        sampler_output = None
        if sampled_seqs:
            metadata = SamplingMetadata(
                params=[seq.params for seq in sampled_seqs],
                generators=[self._generator(seq) for seq in sampled_seqs],
                prompt_token_ids=[seq.prompt_token_ids for seq in sampled_seqs],
                output_token_ids=[seq.output_token_ids for seq in sampled_seqs],
                eos_token_id=self.eos_token_id,
            )
            sampler_output = self.sampler(logits[: len(sampled_seqs)], metadata)

        prompt_logprobs: list[PromptLogprobsChunk] = []
        offset = len(sampled_seqs)
        for (seq, first_position), rows_of_seq in zip(prompt_chunks, prompt_rows):
            seq_logits = logits[offset : offset + len(rows_of_seq)]
            offset += len(rows_of_seq)
            targets = seq.prompt_token_ids[first_position : first_position + len(rows_of_seq)]
            entries = compute_prompt_logprobs(seq_logits, targets, seq.params.prompt_logprobs or 0)
            prompt_logprobs.append(PromptLogprobsChunk(seq, first_position, entries))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return ModelRunnerOutput(sampled_seqs, sampler_output, prompt_logprobs, time.perf_counter() - start_s)

    @staticmethod
    def _prompt_logprob_rows(
        seqs: list[Sequence], num_computed: list[int], query_lens: list[int], cu_query_lens: np.ndarray
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
            first_row = int(cu_query_lens[i])
            rows.append(list(range(first_row, first_row + end - start)))
            chunks.append((seq, start + 1))
        return rows, chunks
