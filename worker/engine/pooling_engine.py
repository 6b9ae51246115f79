"""PoolingEngine: embeddings from an encoder (BERT) or a decoder (last-token pooling) (vLLM's ``runner="pooling"``).

An embedding needs one forward pass per input and no KV cache kept between steps, so this engine has no
scheduler: :meth:`PoolingEngine.embed` sorts its inputs by length, cuts them into batches of at most
``max_num_batched_tokens`` tokens, packs each batch without padding (``[num_tokens, hidden]``, sequence
after sequence), runs the model and pools each sequence (:mod:`worker.engine.executor.layers.pooler`).
A BERT in float32 on CPU runs on the C++ encoder kernels (varlen attention over ``cu_seqlens``, fused
bias/GELU and residual/LayerNorm, oneDNN's prepacked linears:
:meth:`~worker.engine.executor.models.bert.BertModel.enable_cpu_kernels`);
otherwise sorting keeps equal lengths together, so attention runs as few batched calls
(:func:`worker.engine.executor.models.bert.packed_bidirectional_attention`). A decoder runs its ordinary
forward over a scratch KV cache sized for the batch (every sequence one prefill) and returns its final-norm
hidden states: the decoder families need no second forward. docs/engine.md, "Embeddings".
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from kernels.cpu_extension import cpu_kernels_available
from worker.engine.errors import InvalidParameterError, PromptTooLongError
from worker.engine.executor.layers.attention import scratch_prefill_metadata
from worker.engine.executor.layers.pooler import PoolingConfig, finish_embeddings, pool, pooling_config_of
from worker.engine.executor.model_loader import iter_safetensors, load_model, safetensors_files
from worker.engine.executor.models.bert import BertModel
from worker.engine.executor.models.llama import LlamaForCausalLM, head_size_of, num_kv_heads_of
from worker.engine.executor.models.registry import ENCODER_ARCHITECTURES, is_encoder_config

_ST_CONFIG = "sentence_bert_config.json"
_SCRATCH_BLOCK_SIZE = 16
_MAX_IDS_SHOWN = 8


class InputTooLongError(PromptTooLongError):
    """An embedding input longer than the model's limit (``num_tokens > max_model_len``) without truncation."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        ValueError.__init__(
            self,
            f"input has {num_tokens} tokens but the model embeds at most {max_model_len}; "
            "shorten it or set truncate_prompt_tokens",
        )
        self.num_prompt_tokens = num_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True, slots=True)
class EmbeddingEngineConfig:
    """How to build one :class:`PoolingEngine`.

    ``model`` is the model folder; ``dtype``/``device`` as :class:`~worker.engine.config.EngineConfig`;
    ``max_num_batched_tokens`` the most tokens one forward pass packs (raised to ``max_model_len`` if lower);
    ``max_model_len`` the most tokens per input (default the model's limit); ``matmul_dtype`` ``"bfloat16"``
    runs a float32 encoder's linears in bfloat16 on oneDNN (opt-in, :meth:`BertModel.enable_cpu_kernels`;
    ``"float32"``: the reference).
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    matmul_dtype: str = "float32"


@dataclass(frozen=True, slots=True)
class EmbeddingStats:
    """Work of one :meth:`PoolingEngine.embed` call: inputs, tokens, forward passes, wall seconds from the first
    batch to the last (forward passes, pooling and normalisation)."""

    num_inputs: int
    num_tokens: int
    num_batches: int
    forward_s: float


class PoolingEngine:
    """Embeds token-id sequences with one model (:func:`build_embedding_engine` builds one from a folder).

    Attributes:
        tokenizer: the folder's Hugging Face tokenizer; model_config: its ``transformers`` config.
        max_model_len: most tokens one input may have (a sentence-transformers folder's ``max_seq_length``,
            else ``max_position_embeddings``).
        pooling: the model's pooling (:class:`PoolingConfig`).
        hidden_size: width of a full embedding.
        matryoshka_dimensions: the shortened widths served for ``dimensions`` (None: every width up to
            ``hidden_size``; an empty tuple: the model does not support shortening).
        is_encoder: True for a bidirectional encoder (BERT), False for a decoder embedder.
        last_stats: what the latest :meth:`embed` did.
    """

    def __init__(self, config: EmbeddingEngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        self.device, self.dtype = torch.device(config.device), getattr(torch, config.dtype)
        model = _load(model_dir, self.dtype, self.device, config.matmul_dtype)
        self.model = model
        self.model_config: PretrainedConfig = model.config
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.is_encoder = isinstance(model, BertModel)
        self.pooling: PoolingConfig = pooling_config_of(model_dir, is_encoder=self.is_encoder)
        self.hidden_size = int(self.model_config.hidden_size)
        limit = _sentence_transformers_max_len(model_dir) or int(self.model_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self.matryoshka_dimensions = _matryoshka_dimensions(self.model_config)
        self.last_stats = EmbeddingStats(0, 0, 0, 0.0)

    def supports_dimensions(self, dimensions: int) -> bool:
        """Whether ``dimensions`` is a width this model can shorten its embeddings to (its full width always is)."""
        if dimensions == self.hidden_size:
            return True
        if self.matryoshka_dimensions is None:
            return 1 <= dimensions <= self.hidden_size
        return dimensions in self.matryoshka_dimensions

    def tokenize(self, text: str, truncate_prompt_tokens: int | None = None) -> list[int]:
        """``text`` as the model's tokenizer encodes it (special tokens added); with ``truncate_prompt_tokens``
        (``-1``: the model's limit) the tokenizer cuts it to that many tokens on its own side, specials kept."""
        if truncate_prompt_tokens is None:
            ids: list[int] = self.tokenizer.encode(text)
            return ids
        ids = self.tokenizer.encode(text, truncation=True, max_length=self._truncation_limit(truncate_prompt_tokens))
        return ids

    def _truncation_limit(self, truncate_prompt_tokens: int) -> int:
        """Tokens kept under ``truncate_prompt_tokens`` (``-1``: the model's limit; never above it)."""
        return self.max_model_len if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens, self.max_model_len)

    def check_prompt(self, token_ids: Sequence[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        """The ids one input embeds: ``token_ids``, cut to their last ``truncate_prompt_tokens`` when asked
        (``-1``: the model's limit; vLLM's rule for token-id prompts).

        Raises:
            ValueError: an empty input.
            InvalidParameterError: an id outside the vocabulary (``param="input"``).
            InputTooLongError: more than ``max_model_len`` tokens and no truncation asked.
        """
        ids = list(token_ids)
        if not ids:
            raise ValueError("the input is empty")
        vocab_size = int(self.model_config.vocab_size)
        bad = sorted({token_id for token_id in ids if not 0 <= token_id < vocab_size})
        if bad:
            shown = ", ".join(map(str, bad[:_MAX_IDS_SHOWN])) + (", ..." if len(bad) > _MAX_IDS_SHOWN else "")
            raise InvalidParameterError(
                f"holds token ids outside the vocabulary [0, {vocab_size}): {shown} ({len(bad)} in all)", "input"
            )
        if truncate_prompt_tokens is not None:
            ids = ids[-self._truncation_limit(truncate_prompt_tokens) :]
        if len(ids) > self.max_model_len:
            raise InputTooLongError(len(ids), self.max_model_len)
        return ids

    @torch.inference_mode()
    def embed(
        self, prompt_token_ids: Sequence[Sequence[int]], *, dimensions: int | None = None, normalize: bool | None = None
    ) -> torch.Tensor:
        """Embed each input.

        Args:
            prompt_token_ids: one list of token ids per input, each already checked (:meth:`check_prompt`).
            dimensions: shorten to this width (Matryoshka; :meth:`supports_dimensions`); None: full width.
            normalize: L2-normalise; None: as the model's configuration says (``pooling.normalize``).

        Returns:
            float32 ``[len(prompt_token_ids), dimensions or hidden_size]`` on the CPU, in input order.

        Raises:
            ValueError: an empty or too long input, or ``dimensions`` the model does not serve.
        """
        if dimensions is not None and not self.supports_dimensions(dimensions):
            raise ValueError(f"the model does not serve dimensions={dimensions}")
        lengths = np.fromiter((len(ids) for ids in prompt_token_ids), dtype=np.int64, count=len(prompt_token_ids))
        if lengths.size and (lengths.min() < 1 or lengths.max() > self.max_model_len):
            raise ValueError(f"every input must hold 1 to {self.max_model_len} tokens")
        width = dimensions or self.hidden_size
        out = torch.empty(len(prompt_token_ids), width, dtype=torch.float32)
        norm = self.pooling.normalize if normalize is None else normalize
        batches = self._batches(lengths)

        def run(batch: np.ndarray) -> None:
            with torch.inference_mode():
                pooled = self._forward_pool([prompt_token_ids[i] for i in batch])
                out[torch.from_numpy(batch)] = finish_embeddings(pooled, dimensions=dimensions, normalize=norm).cpu()

        started_s = time.perf_counter()
        threads = torch.get_num_threads()
        num_streams = min(threads, len(batches)) if self.device.type == "cpu" else 1
        if num_streams > 1:
            # NOTE: batches run side by side, one per thread, each op on its own thread (torch's thread count is
            # process-wide, so it is 1 until they finish): no barrier between the threads at every op
            # (docs/engine.md, "Embeddings").
            torch.set_num_threads(1)
            try:
                with ThreadPoolExecutor(num_streams, thread_name_prefix="embed-stream") as executor:
                    list(executor.map(run, batches))
            finally:
                torch.set_num_threads(threads)
        else:
            for batch in batches:
                run(batch)
        self.last_stats = EmbeddingStats(
            len(prompt_token_ids), int(lengths.sum()), len(batches), time.perf_counter() - started_s
        )
        return out

    def _batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Input indices cut into batches of at most ``max_num_batched_tokens`` tokens, longest inputs first."""
        # NOTE: longest first, so the largest batch (and its memory) comes first and equal lengths sit together.
        order = np.argsort(-lengths, kind="stable")
        batches, start = [], 0
        while start < len(order):
            end, budget = start, 0
            while end < len(order) and (end == start or budget + lengths[order[end]] <= self.max_num_batched_tokens):
                budget += int(lengths[order[end]])
                end += 1
            batches.append(order[start:end])
            start = end
        return batches

    def _forward_pool(self, batch: list[Sequence[int]]) -> torch.Tensor:
        """Pooled float32 ``[len(batch), hidden_size]`` of one packed batch."""
        seq_lens = [len(ids) for ids in batch]
        flat = np.fromiter((token for ids in batch for token in ids), dtype=np.int64, count=sum(seq_lens))
        input_ids = torch.from_numpy(flat).to(self.device)
        starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
        positions = torch.from_numpy(np.arange(len(flat)) - starts).to(self.device)
        if isinstance(self.model, BertModel):
            hidden = self.model(input_ids, positions, seq_lens)
        else:
            hidden = self._decoder_forward(input_ids, seq_lens)
        return pool(hidden, seq_lens, self.pooling.pooling_type)

    def _decoder_forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """The decoder's final-norm hidden states: every sequence one prefill into a scratch KV cache."""
        model = self.model
        assert isinstance(model, LlamaForCausalLM)
        config = model.config
        num_kv_heads, head_size = num_kv_heads_of(config), head_size_of(config)
        scratch = scratch_prefill_metadata(
            seq_lens,
            _SCRATCH_BLOCK_SIZE,
            num_queries_per_kv=int(config.num_attention_heads) // num_kv_heads,
            dtype=self.dtype,
            device=self.device,
            sliding_window=model.sliding_window,
        )
        shape = (2, scratch.num_blocks, _SCRATCH_BLOCK_SIZE, num_kv_heads, head_size)
        kv_caches = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in model.model.layers]
        hidden: torch.Tensor = model(input_ids, scratch.metadata.positions, kv_caches, scratch.metadata)
        return hidden


def build_embedding_engine(
    model_dir: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_num_batched_tokens: int = 4096,
    max_model_len: int | None = None,
    matmul_dtype: str = "float32",
) -> PoolingEngine:
    """A :class:`PoolingEngine` over the Hugging Face (or sentence-transformers) folder ``model_dir``
    (arguments: :class:`EmbeddingEngineConfig`; a built-in name is resolved first by
    ``worker.model_prepare.prepare_model``).

    Raises:
        FileNotFoundError, UnsupportedModelError, ValueError, KeyError: as ``load_model``.
    """
    return PoolingEngine(
        EmbeddingEngineConfig(str(model_dir), dtype, device, max_num_batched_tokens, max_model_len, matmul_dtype)
    )


def _load(
    model_dir: Path, dtype: torch.dtype, device: torch.device, matmul_dtype: str = "float32"
) -> BertModel | LlamaForCausalLM:
    """The folder's model, for embeddings.

    An encoder architecture (:data:`~worker.engine.executor.models.registry.ENCODER_ARCHITECTURES`: BERT)
    is loaded as :class:`~worker.engine.executor.models.bert.BertModel` with ``nn.Linear`` weights, on the C++
    encoder kernels (with oneDNN's prepacked linears where torch has oneDNN) when it is float32 on CPU and the
    kernels are available; any decoder family the engine serves is loaded as for generation
    (:func:`~worker.engine.executor.model_loader.load_model`).

    Raises:
        ValueError: ``matmul_dtype`` is neither ``"float32"`` nor ``"bfloat16"``, or ``"bfloat16"`` where the
            model does not run on the encoder kernels with oneDNN's bfloat16 (a decoder, another dtype or device).
    """
    if matmul_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"matmul_dtype must be 'float32' or 'bfloat16', got {matmul_dtype!r}")
    config = AutoConfig.from_pretrained(model_dir)
    bf16_refused = ValueError("matmul_dtype='bfloat16' needs a float32 encoder on CPU with the C++ kernels")
    if not is_encoder_config(config):
        if matmul_dtype != "float32":
            raise bf16_refused
        return load_model(model_dir, dtype, device)
    safetensors_files(model_dir)  # NOTE: raises before the model is allocated
    with torch.device(device):
        model = ENCODER_ARCHITECTURES[config.model_type](config)
    model.to(device=device, dtype=dtype)
    model.load_weights(iter_safetensors(model_dir))
    model.eval()
    model.requires_grad_(False)
    if dtype == torch.float32 and device.type == "cpu" and _kernels_fit(config) and cpu_kernels_available():
        model.enable_cpu_kernels(getattr(torch, matmul_dtype))
    elif matmul_dtype != "float32":
        raise bf16_refused
    return model


def _kernels_fit(config: PretrainedConfig) -> bool:
    """Whether the C++ encoder kernels take this BERT's shapes (head size and MLP width multiples of 8)."""
    head_size = int(config.hidden_size) // int(config.num_attention_heads)
    return head_size % 8 == 0 and int(config.intermediate_size) % 8 == 0


def _sentence_transformers_max_len(model_dir: Path) -> int | None:
    """``max_seq_length`` of a sentence-transformers folder (what its ``encode`` truncates to), else None."""
    path = model_dir / _ST_CONFIG
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return int(value) if value else None


def _matryoshka_dimensions(config: PretrainedConfig) -> tuple[int, ...] | None:
    """The widths a Matryoshka model serves (vLLM reads the same config keys): ``matryoshka_dimensions`` when
    listed, None (any width) when only ``is_matryoshka`` is set, an empty tuple when the model cannot shorten."""
    listed = getattr(config, "matryoshka_dimensions", None)
    if listed:
        return tuple(int(d) for d in listed)
    return None if getattr(config, "is_matryoshka", False) else ()
