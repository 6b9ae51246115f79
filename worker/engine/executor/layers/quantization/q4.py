"""4-bit group-wise linear layers: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, or Q4_1 made at load from an HF folder.

Decode reads every weight once per step, so at small batches its speed is bytes moved: a Q4_1 block holds 32
weights in 20 bytes (0.625 bytes a weight against float32's 4). :func:`quantize_linear_layers_q4` swaps every
decoder linear layer (q/k/v, o, gate/up, down) for a :class:`GGUFLinear` whose weight is the blocks exactly as
the GGUF holds them (read with the ``gguf`` package; no round trip through float), run by
:func:`kernels.cpu_q4.linear_gguf` with float32 activations (weight-only: only the summation order differs from
the same file dequantized to float32). The LM head follows the file too: its ``output.weight``, else the tied
``token_embd.weight`` (SmolLM2's is Q8_0). The embedding table and the norms stay float32 (the file's norms are
F32; an embedding reads one row a token). A folder without a GGUF is quantized to Q4_1 at load
(:func:`kernels.reference.quantize_q4_1`); its LM head then stays float32. docs/engine.md, "Quantized weights".

A bfloat16 model (on a CPU with AVX512_BF16) gets :class:`GGUFLinearBF16` instead for Q4_0 / Q4_1 tensors: the same
blocks regrouped at load for :func:`kernels.cpu_q4.linear_gguf_bf16` (bfloat16 activations, the integer quants
exact in ``vdpbf16ps``); a Q8_0 tensor there (SmolLM2's LM head) keeps the model's bfloat16 layer.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` per head for its RoPE layout; rows are whole
blocks, so they are put back in Hugging Face order by indexing rows, the blocks untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.cpu_elementwise import gguf_bf16_kind
from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_q4 import (
    GGUF_BF16_BLOCK_TYPES,
    GGUF_BLOCK_BYTES,
    GGUF_BLOCK_SIZE,
    GGUF_BLOCK_TYPES,
    gguf_bf16_supported,
    gguf_kernel_isa,
    gguf_pack_bf16,
    linear_gguf,
    linear_gguf_bf16,
)
from kernels.reference import quantize_q4_1
from worker.engine.executor.forward_context import step_is_batch_invariant

FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types whose layers stay float32 (as the HF folder loaded them)


class GGUFLinear(nn.Module):
    """``nn.Linear`` inference twin over GGUF blocks: ``[..., in_features] -> [..., out_features]`` float32.

    ``blocks`` uint8 ``[out_features, in_features / 32 * block_bytes]`` in ggml's layout, ``block_type`` the
    ggml type id (:data:`kernels.cpu_q4.GGUF_BLOCK_TYPES`); the bias (if any) stays float32.
    ``quantize_activations`` (off: weight-only) switches to the kernel's int8-activation path, which
    bench/quant.py measures against it (docs/engine.md, "Quantized weights").
    """

    def __init__(self, blocks: torch.Tensor, block_type: int, in_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.block_type = block_type
        self.blocks = nn.Buffer(blocks.contiguous(), persistent=False)
        self.bias = bias
        self.quantize_activations = False

    def cpu_kernel_weight(self) -> tuple[torch.Tensor, int] | None:
        """``(blocks, ggml type id)``, the arguments of the fused decoder-layer kernels
        (:func:`kernels.cpu_elementwise.decoder_attention_input_cpu`), which run float32 activations: the
        caller checks ``quantize_activations`` on every call (the bench sets it after load)."""
        return self.blocks, self.block_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return linear_gguf(x, self.blocks, self.block_type, self.out_features, bias, self.quantize_activations)


class GGUFLinearBF16(nn.Module):
    """``nn.Linear`` inference twin for bfloat16 models over Q4_0 / Q4_1 blocks: ``[..., in_features] ->
    [..., out_features]`` bfloat16.

    ``blocks`` uint8 ``[out_features, in_features / 32 * block_bytes]`` in ggml's layout are regrouped once
    (:func:`kernels.cpu_q4.gguf_pack_bf16`, the same bits a weight) into ``packed_blocks``; ``forward`` runs
    :func:`kernels.cpu_q4.linear_gguf_bf16` (float32 accumulation, rounded to bfloat16 once; exact Q4 weights in
    calls of up to 24 rows, bfloat16-rounded ones in taller calls, so batch invariant within each range only),
    exact Q4 weights at every height in a step that must be batch invariant
    (:func:`~worker.engine.executor.forward_context.step_is_batch_invariant`). The fused bfloat16 decoder layers run
    it too (``cpu_kernel_weight``).
    """

    def __init__(self, blocks: torch.Tensor, block_type: int, in_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.block_type = block_type
        self.packed_blocks = nn.Buffer(gguf_pack_bf16(blocks, block_type, in_features), persistent=False)
        self.bias = bias

    def cpu_kernel_weight(self) -> tuple[torch.Tensor, int] | None:
        """``(packed_blocks, kernels.cpu_elementwise.gguf_bf16_kind(block_type))``, the arguments of the fused
        decoder-layer kernels (:func:`kernels.cpu_elementwise.decoder_attention_input_cpu`), which call the same C++
        function as :meth:`forward`."""
        return self.packed_blocks, gguf_bf16_kind(self.block_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return linear_gguf_bf16(
            x, self.packed_blocks, self.block_type, self.out_features, bias, step_is_batch_invariant()
        )


def _block_linear(
    dtype: torch.dtype, blocks: torch.Tensor, block_type: int, in_features: int, bias: nn.Parameter | None
) -> nn.Module | None:
    """The layer over ``blocks`` for a model of ``dtype``: :class:`GGUFLinear` (float32), :class:`GGUFLinearBF16`
    (bfloat16, Q4_0 / Q4_1), or ``None`` (bfloat16 and another block type: the model's bfloat16 layer stays)."""
    if dtype == torch.float32:
        return GGUFLinear(blocks, block_type, in_features, bias)
    if block_type in GGUF_BF16_BLOCK_TYPES:
        return GGUFLinearBF16(blocks, block_type, in_features, bias)
    return None


def find_gguf(model_dir: Path) -> Path | None:
    """The GGUF file in ``model_dir`` (``None`` when there is none).

    Raises:
        ValueError: when the folder holds more than one (which one is meant is ambiguous).
    """
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{model_dir} holds several GGUF files ({', '.join(f.name for f in files)}); keep one")
    return files[0] if files else None


def read_gguf_tensors(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF file as ``name -> (type name, raw uint8 rows)``, copied out of the memory map.

    Raw rows are ``[rows, bytes per row]`` as ``gguf.GGUFReader`` exposes quantized tensors; float tensors
    come as their own dtype.

    Raises:
        ValueError: the file is not a readable GGUF (bad magic, truncated, inconsistent sizes), named.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        tensors = {}
        for tensor in reader.tensors:
            data = tensor.data
            if data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} holds {data.nbytes} bytes, its header says {tensor.n_bytes}")
            tensors[tensor.name] = (tensor.tensor_type.name, torch.from_numpy(data.copy()))
    except Exception as exc:  # NOTE: gguf raises ValueError, struct.error, IndexError... on damaged files
        raise ValueError(f"corrupt GGUF file {path}: {exc}") from exc
    return tensors


def _block_rows(name: str, entry: tuple[str, torch.Tensor], shape: tuple[int, int]) -> tuple[int, torch.Tensor]:
    """``(ggml type id, uint8 [rows, row bytes])`` of a quantized GGUF tensor checked against ``shape``."""
    type_name, data = entry
    if type_name not in GGUF_BLOCK_TYPES:
        served = ", ".join([*GGUF_BLOCK_TYPES, *FLOAT_TYPES])
        raise ValueError(f"GGUF tensor {name} has type {type_name}, which quantization 'q4' does not serve ({served})")
    block_type = GGUF_BLOCK_TYPES[type_name]
    rows, cols = shape
    expected = (rows, cols // GGUF_BLOCK_SIZE * GGUF_BLOCK_BYTES[block_type])
    if cols % GGUF_BLOCK_SIZE or tuple(data.shape) != expected or data.dtype != torch.uint8:
        raise ValueError(
            f"GGUF tensor {name} ({type_name}) is {tuple(data.shape)} {data.dtype}; the model expects a "
            f"[{rows}, {cols}] weight ({expected} bytes)"
        )
    return block_type, data


def _unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's per-head RoPE permutation (transformers' ``_reverse_permute_weights``)."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def quantize_linear_layers_q4(model: nn.Module, gguf_path: Path | None) -> int:
    """Replace the decoder linear layers of ``model`` (and the LM head, from a GGUF) by :class:`GGUFLinear`.

    Call after the float32 weights are loaded, before
    :func:`~worker.engine.executor.layers.linear.pack_linear_layers` (which packs what stayed float32).

    Args:
        model: a loaded float32 (or, on a CPU with AVX512_BF16, bfloat16) CPU
            :class:`~worker.engine.executor.models.llama.LlamaForCausalLM` (fused ``qkv_proj`` and ``gate_up_proj``).
        gguf_path: the GGUF the model folder was converted from (blocks used as they are); ``None``: quantize
            the float32 weights to Q4_1 at load.

    Returns:
        The number of layers replaced.

    Raises:
        ValueError: when q4 cannot run here (kernels unavailable, or the CPU lacks AVX2/FMA/F16C, or
            AVX512_BF16 for a bfloat16 model, named); a weight not float32 or bfloat16 on CPU; a GGUF tensor of a
            type not served, absent or mis-shaped (named); a corrupt GGUF file.
    """
    if not cpu_kernels_available():
        raise ValueError("quantization 'q4' needs the C++ CPU kernels, which are unavailable or disabled here")
    if not gguf_kernel_isa():
        raise ValueError("quantization 'q4' needs a CPU with AVX2, FMA and F16C; this one lacks them")
    dtype = next(model.parameters()).dtype
    for name, param in model.named_parameters():
        if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16) or param.dtype != dtype:
            raise ValueError(
                f"quantization 'q4' runs float32 or bfloat16 models on CPU; {name} is {param.dtype} on {param.device}"
            )
    if dtype == torch.bfloat16 and not gguf_bf16_supported():
        raise ValueError(
            "quantization 'q4' with dtype bfloat16 needs a CPU with AVX512_BF16, which this one (or build) lacks; "
            "use dtype float32"
        )
    if gguf_path is None:
        return _quantize_at_load(model, dtype)
    return _load_gguf_blocks(model, gguf_path, dtype)


def _decoder_linears(model: Any) -> list[tuple[int, str, nn.Module, str]]:
    """``(layer index, attribute, parent module, kind)`` of each decoder linear layer."""
    found = []
    for index, layer in enumerate(model.model.layers):
        found += [
            (index, "qkv_proj", layer.self_attn, "qkv"),
            (index, "o_proj", layer.self_attn, "attn_output"),
            (index, "gate_up_proj", layer.mlp, "gate_up"),
            (index, "down_proj", layer.mlp, "ffn_down"),
        ]
    return found


def _quantize_at_load(model: Any, dtype: torch.dtype) -> int:
    replaced = 0
    for _, attribute, parent, _ in _decoder_linears(model):
        linear = getattr(parent, attribute)
        setattr(
            parent, attribute, _block_linear(dtype, quantize_q4_1(linear.weight), 3, linear.in_features, linear.bias)
        )
        replaced += 1
    return replaced


def _load_gguf_blocks(model: Any, gguf_path: Path, dtype: torch.dtype) -> int:
    tensors = read_gguf_tensors(gguf_path)
    config = model.config
    attention = model.model.layers[0].self_attn
    num_heads, num_kv_heads, head_size = attention.num_heads, attention.num_kv_heads, attention.head_size
    hidden, intermediate = config.hidden_size, config.intermediate_size

    def get(name: str) -> tuple[str, torch.Tensor]:
        if name not in tensors:
            raise ValueError(f"GGUF file {gguf_path} has no tensor {name}")
        return tensors[name]

    def blocks(names: list[tuple[str, tuple[int, int], int | None]]) -> tuple[int, torch.Tensor] | None:
        """Blocks of the named tensors stacked by rows (``None`` when they are float: the layer stays float32)."""
        parts, types = [], set()
        for name, shape, heads in names:
            if get(name)[0] in FLOAT_TYPES:
                return None
            block_type, data = _block_rows(name, get(name), shape)
            parts.append(data[_unpermute_rows(shape[0], heads)] if heads else data)
            types.add(block_type)
        if len(types) > 1:
            raise ValueError(f"GGUF tensors {', '.join(n for n, _, _ in names)} mix block types; one layer needs one")
        return types.pop(), torch.cat(parts)

    replaced = 0
    for index, attribute, parent, kind in _decoder_linears(model):
        prefix = f"blk.{index}."
        spec: list[tuple[str, tuple[int, int], int | None]]
        if kind == "qkv":
            spec = [
                (prefix + "attn_q.weight", (num_heads * head_size, hidden), num_heads),
                (prefix + "attn_k.weight", (num_kv_heads * head_size, hidden), num_kv_heads),
                (prefix + "attn_v.weight", (num_kv_heads * head_size, hidden), None),
            ]
        elif kind == "gate_up":
            spec = [
                (prefix + "ffn_gate.weight", (intermediate, hidden), None),
                (prefix + "ffn_up.weight", (intermediate, hidden), None),
            ]
        elif kind == "attn_output":
            spec = [(prefix + "attn_output.weight", (hidden, num_heads * head_size), None)]
        else:
            spec = [(prefix + "ffn_down.weight", (hidden, intermediate), None)]
        found = blocks(spec)
        linear = getattr(parent, attribute)
        layer = None if found is None else _block_linear(dtype, found[1], found[0], linear.in_features, linear.bias)
        if layer is not None:
            setattr(parent, attribute, layer)
            replaced += 1
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = blocks([(head_name, (config.vocab_size, hidden), None)])
    head_layer = None if head is None else _block_linear(dtype, head[1], head[0], hidden, model.lm_head.bias)
    if head_layer is not None:
        model.lm_head = head_layer
        replaced += 1
    return replaced
