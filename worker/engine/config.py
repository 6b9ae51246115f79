"""Engine configuration (vLLM's ``EngineArgs`` subset that batchinfer uses)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.executor.layers.attention.kv_cache import check_kv_cache_dtype
from worker.engine.executor.layers.quantization import check_quantization

SPECULATIVE_METHODS = ("ngram", "draft", "eagle", "medusa", "auto")


@dataclass(slots=True)
class EngineConfig:
    """How to build one :class:`~worker.engine.llm_engine.LLMEngine`.

    ``model`` is a Hugging Face folder (``config.json``, ``*.safetensors``, tokenizer files).
    The KV cache gets ``kv_cache_memory_bytes`` (bytes) unless ``num_gpu_blocks_override`` forces a
    number of blocks (tests use it to make preemption happen). ``block_size`` is tokens per KV block:
    8 by default, not 16 (docs/engine.md, "Block size"; NOTE: measured on the HumanEval workload, 8 keeps KV utilisation
    near 98% instead of 95.6% at no cost in speed, since decode attention reads blocks in place).
    ``max_num_batched_tokens`` is the per-step token budget, ``max_num_seqs`` the cap on running
    sequences; ``max_model_len`` (prompt + output tokens) defaults to the model's
    ``max_position_embeddings``. ``enable_prefix_caching`` reuses KV blocks of identical prefixes
    (invisible in the output). ``enable_forks`` shares a request's KV blocks between its branches
    (``n``/``best_of`` samples, beams) by copy-on-write forks; off, every branch holds its own copy
    (samples are prefilled separately, a beam fork copies all its parent's blocks, and the prefix cache
    never shares blocks between branches), which gives the same tokens with more blocks: the baseline
    of bench/forks.py (docs/engine.md, "Requests and sequences").

    Speculative decoding (docs/engine.md, "Speculative decoding"; vLLM's names where it has them):
    ``speculative_mode`` is ``"off"``, ``"auto"`` (speculate while at most
    ``speculative_disable_by_batch_size`` sequences run and the measured acceptance pays) or ``"on"``
    (always, at any batch size). ``speculative_method`` is ``"ngram"`` (prompt lookup of
    ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens) or ``"draft"`` (a draft model: the folder
    ``speculative_model``, or by default the target's first ``speculative_draft_num_layers`` layers with its
    final norm and LM head), ``"eagle"`` (an EAGLE head) or ``"medusa"`` (Medusa heads): the heads' folder is
    ``speculative_model``, by default ``<model>/heads/<method>`` (``batchinfer heads train`` writes it), or ``"auto"``
    (n-gram lookup and the heads found beside the model, chosen per sequence and step by measured acceptance and
    cost).
    ``num_speculative_tokens`` is the most drafts per step (a tree's depth; Medusa drafts at most one per head).
    ``speculative_tree_width``: the most nodes per depth of a draft tree, verified in one pass (1: chains): n-gram
    lookup's distinct earlier continuations of the matched n-gram; EAGLE-2's dynamic tree and Medusa's product
    tree of the heads' top tokens (greedy lines).

    Structured outputs (docs/engine.md, "Structured outputs"): ``structured_outputs_compile_timeout_s`` is the
    longest ``add_request`` waits for one grammar compile before it fails that request (seconds).
    ``enable_jump_forward`` appends the tokens a grammar forces (keys, punctuation, the rest of an enum value)
    without a forward pass each (jump-forward decoding); the model computes them in one extend.
    ``quantization`` is ``"none"``, ``"int8"`` (weight-only int8 linear layers on CPU float32) or ``"q4"`` (the
    folder's GGUF blocks, else Q4_1 made at load; float32, or bfloat16 on a CPU with AVX512_BF16; docs/engine.md,
    "Quantized weights"). ``kv_cache_dtype`` is ``"auto"`` (the KV cache
    in ``dtype``), ``"int8"`` or ``"fp8_e4m3"`` (vLLM's ``"fp8"`` is an alias, stored canonical): one byte per
    element plus a float32 scale per (token, KV head), so ``kv_cache_memory_bytes`` holds more blocks
    (docs/engine.md, "Quantized KV cache"). ``prepared_weights_dir``, when set, caches a float32 CPU model's
    packed weights there and memory-maps them on later starts, and the folder's resolved ``transformers`` config and
    tokenizer class (:mod:`worker.engine.model_files`; docs/operations.md, "Worker start").

    Raises:
        ValueError: on a non-positive size, or a quantization or KV cache dtype not served.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 8
    kv_cache_memory_bytes: int = 1 << 30
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_forks: bool = True
    speculative_mode: str = "off"
    speculative_method: str = "ngram"
    num_speculative_tokens: int = 12
    speculative_disable_by_batch_size: int = 16
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 8
    speculative_tree_width: int = 1
    speculative_model: str | None = None
    speculative_draft_num_layers: int | None = None
    structured_outputs_compile_timeout_s: float = 10.0
    enable_jump_forward: bool = True
    quantization: str = "none"
    prepared_weights_dir: str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("block_size", "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.speculative_mode not in ("off", "auto", "on"):
            raise ValueError(f"speculative_mode must be 'off', 'auto' or 'on', got {self.speculative_mode!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}"
            )
        for name in (
            "num_speculative_tokens",
            "speculative_disable_by_batch_size",
            "prompt_lookup_min",
            "speculative_tree_width",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min")
        if self.structured_outputs_compile_timeout_s <= 0:
            raise ValueError(
                f"structured_outputs_compile_timeout_s must be > 0, got {self.structured_outputs_compile_timeout_s}"
            )
        if self.speculative_draft_num_layers is not None and self.speculative_draft_num_layers < 1:
            raise ValueError(f"speculative_draft_num_layers must be >= 1, got {self.speculative_draft_num_layers}")
