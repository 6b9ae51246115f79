"""Build and load batchinfer's C++ CPU kernels (one Torch extension library), compiled on first use.

Sources: ``cpu_attention.cpp`` (paged attention), ``cpu_elementwise.cpp`` (fused norms, SwiGLU, rotary
embeddings), ``cpu_gemm.cpp`` (packed-weight linear layer) and ``cpu_sampling.cpp`` (exponential race),
next to this file. The first call builds them with :func:`torch.utils.cpp_extension.load`
(``-O3 -march=native -fno-trapping-math -fopenmp``) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); later processes reuse the built library, and concurrent builders wait on
torch's file baton. The library registers the Torch ops ``torch.ops.batchinfer_cpu.*``. Because
``-march=native`` ties the binary to the CPU, the extension name carries a digest of the CPU's feature
flags, of the compiler flags and of the sources, so a shared cache never hands one machine another's build or a stale one.

Set ``BATCHINFER_CPU_KERNELS=0`` to disable the kernels (:func:`cpu_kernels_available` then returns
``False`` and callers use their PyTorch paths). When the build fails (no compiler, no ninja), a warning is
logged once and the kernels stay unavailable for the life of the process.

This module imports nothing of batchinfer's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "BATCHINFER_CPU_KERNELS"
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_attention.cpp", "cpu_elementwise.cpp", "cpu_gemm.cpp", "cpu_sampling.cpp")
]
_HEADERS = [Path(__file__).with_name("cpu_exp.h")]
# NOTE: -fno-trapping-math lets GCC if-convert float comparisons (the clamp of exp_clamped) on AVX2, where it
# would otherwise leave the exp loops of the softmax and SiLU scalar; it only drops the assumption that
# floating-point exceptions are observed, so every value computed is unchanged.
_CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]

_loaded: bool | None = None  # None: not tried yet; False: the build failed


def _build_tag() -> str:
    """Short digest of the machine type, the CPU feature flags (``/proc/cpuinfo``), the compiler flags and the
    sources."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    digest = hashlib.sha256(f"{platform.machine()} {flags} {' '.join(_CFLAGS)}".encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def load_cpu_kernels() -> bool:
    """Build (first time) and load the library; ``True`` when its ops are registered.

    Does not look at ``BATCHINFER_CPU_KERNELS``: callers that honour it use :func:`cpu_kernels_available`.
    """
    global _loaded
    if _loaded is None:
        try:
            from torch.utils.cpp_extension import load

            load(
                name=f"batchinfer_cpu_{_build_tag()}",
                sources=[str(source) for source in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _loaded = True
        except Exception as exc:
            logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", exc)
            _loaded = False
    return _loaded


def require_cpu_kernels() -> None:
    """Load the library (see :func:`load_cpu_kernels`) or raise.

    Raises:
        RuntimeError: the kernels could not be built or loaded.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the C++ CPU kernels are unavailable")


def cpu_kernels_available() -> bool:
    """Whether the C++ kernels can run here: not disabled by ``BATCHINFER_CPU_KERNELS=0`` and built.

    The first call that gets past the environment check builds or loads the library (seconds to a
    minute on a cold cache).
    """
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return load_cpu_kernels()
