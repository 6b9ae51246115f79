"""float32 and bfloat16 linear layers through oneDNN with prepacked weights, optionally with GELU applied in the
same pass.

torch's ``F.linear`` runs float32 on MKL's sgemm. On CPUs where MKL does not dispatch its AVX-512 kernels
(AMD Zen 4 here: 70-86 GFLOP per CPU second at BERT's shapes) oneDNN's JIT-generated AVX-512 kernels are
faster (92-105), more so with the weight reordered once into oneDNN's blocked layout. These are the ops
torch's own inductor emits for a frozen CPU graph (``torch._inductor.fx_passes.mkldnn_fusion``):
``torch.ops.mkldnn._reorder_linear_weight`` packs, ``torch.ops.mkldnn._linear_pointwise`` multiplies, adds the
bias and applies an elementwise post-op (``"gelu"`` with algorithm ``"none"``: the exact erf form).

oneDNN builds (JIT-compiles) one primitive per distinct input height and caches it, so a caller that varies
the row count with every call pays that build (a few milliseconds) per new height: :func:`padded_rows` rounds a
row count up to the multiple the callers pad their token batches to.

bfloat16 on a CPU with AMX-BF16 (:func:`amx_bf16_available`; Sapphire Rapids and later Xeons) runs on AMX tiles:
4-14x the AVX512_BF16 packed kernel (``kernels/cpu_gemm_bf16.cpp``) per thread from 16 rows up at SmolLM2's
shapes (docs/engine.md, "Packed-weight CPU GEMM").
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_flags

_ROW_MULTIPLE = 64  # rows a padded token batch is a multiple of (few primitive builds, < 64 wasted rows)


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN on this CPU and the prepacked-linear ops."""
    mkldnn = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def amx_bf16_available() -> bool:
    """Whether the CPU reports AMX-BF16 (``amx_bf16`` in ``/proc/cpuinfo``), on which oneDNN runs bfloat16 GEMMs
    on tiles; False where the file is unreadable (not Linux)."""
    return "amx_bf16" in cpu_flags()


def pack_linear_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """``weight`` (float32 or bfloat16 ``[out_features, in_features]``, ``nn.Linear``'s layout) reordered into oneDNN's
    blocked layout for inputs of about ``batch_size_hint`` rows; an opaque ``torch._mkldnn`` tensor that only
    :func:`packed_linear` reads."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)
    return packed


def packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (then exact erf GELU when ``gelu``) on oneDNN.

    Args:
        x: ``[rows, in_features]`` in the weight's dtype, contiguous.
        packed_weight: from :func:`pack_linear_weight`.
        bias: ``[out_features]`` in the weight's dtype, or None.

    Returns:
        ``[rows, out_features]`` in the weight's dtype; differs from ``F.linear`` by float32 rounding only (another
        summation order; bfloat16 accumulates in float32 and rounds once). A row's result may depend on the
        number of rows (oneDNN picks its kernel and blocking by the height): not batch invariant.
    """
    if gelu:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "gelu", [], "none")
    else:
        out = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return out


def padded_rows(num_rows: int, multiple: int = _ROW_MULTIPLE) -> int:
    """``num_rows`` rounded up to ``multiple`` (by default the row multiple a token batch is padded to; see the
    module docstring)."""
    return -(-num_rows // multiple) * multiple
