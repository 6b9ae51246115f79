"""C++ paged attention for CPUs: reads K/V from the cache blocks in place, compiled on first use.

The source is ``cpu_attention.cpp`` next to this file. The first call builds it with
:func:`torch.utils.cpp_extension.load` (``-O3 -march=native -fopenmp``) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later processes reuse the built
library, and concurrent builders wait on torch's file baton. The library registers the Torch op
``torch.ops.batchinfer_cpu.paged_attention_``. Because ``-march=native`` ties the binary to the CPU, the
extension name carries a digest of the CPU's feature flags, so a shared cache never hands one machine
another's build.

Set ``BATCHINFER_CPU_KERNELS=0`` to disable the kernel (:func:`cpu_attention_available` then returns
``False``). When the build fails (no compiler, no ninja), a warning is logged once and the kernel stays
unavailable for the life of the process.

This module imports nothing of batchinfer's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "BATCHINFER_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_loaded: bool | None = None  # None: not tried yet; False: the build failed


def _cpu_tag() -> str:
    """Short digest of the machine type and CPU feature flags (``/proc/cpuinfo`` where there is one)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _load() -> bool:
    global _loaded
    if _loaded is None:
        try:
            from torch.utils.cpp_extension import load

            load(
                name=f"batchinfer_cpu_attention_{_cpu_tag()}",
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _loaded = True
        except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the fallback"
            logger.warning("C++ CPU attention kernel unavailable (%s); using the PyTorch path", exc)
            _loaded = False
    return _loaded


def cpu_attention_available() -> bool:
    """Whether the C++ kernel can run here: not disabled by ``BATCHINFER_CPU_KERNELS=0`` and built.

    The first call that gets past the environment check builds or loads the library (seconds to a
    minute on a cold cache).
    """
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _load()


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention of every query token over its sequence's cached context (no K/V gather).

    Same contract as :func:`kernels.reference.paged_attention_reference`: sequence ``s`` owns query rows
    ``query_start_loc[s] : query_start_loc[s + 1]``, the last ``query_len`` positions of its
    ``seq_lens[s]``-token context (already in the cache); query row ``i`` sees positions up to
    ``seq_lens[s] - query_len + i``. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Softmax is exact (two passes over the scores) in float32; slots outside a sequence's context are
    never read. Work is split over (token, KV head) pairs across ``torch.get_num_threads()`` threads.

    Args:
        query: float32 ``[num_tokens, num_heads, head_size]`` on CPU, unit stride in the last dim
            (a strided view of a fused QKV projection is fine).
        kv_cache: float32 contiguous ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
        query_start_loc: int32 ``[num_seqs + 1]`` prefix sums of the query lengths (from 0 to num_tokens).
        seq_lens: int32 ``[num_seqs]`` context lengths including this step's tokens.
        block_tables: int32 contiguous ``[num_seqs, max_num_blocks_per_seq]``.
        scale: multiplier of ``q . k``.

    Returns:
        float32 contiguous ``[num_tokens, num_heads, head_size]``.

    Raises:
        RuntimeError: when the kernel is unavailable (check :func:`cpu_attention_available` first), or
            on bad shapes, dtypes, lengths or out-of-range block ids.
    """
    if not _load():
        raise RuntimeError("the C++ CPU attention kernel is unavailable")
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.batchinfer_cpu.paged_attention_(out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale)
    return out
