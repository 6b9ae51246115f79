"""Build and load batchinfer's C++ CPU kernels (one Torch extension library), compiled on first use.

Sources: ``cpu_attention.cpp`` (paged attention), ``cpu_varlen_attention.cpp`` (bidirectional attention
over packed sequences, for encoders, and causal, for decoders' fresh prompts), ``cpu_elementwise.cpp`` (fused norms, SwiGLU, GELU, rotary
embeddings), ``cpu_gemm.cpp`` (packed-weight linear layer), ``cpu_gemm_bf16.cpp`` (its bfloat16 twin on
AVX512_BF16), ``cpu_kv_store.cpp`` (quantize-on-store of a quantized KV cache), ``cpu_q4.cpp`` (linear layer
over a GGUF's quantized blocks), ``cpu_q4_bf16.cpp`` (Q4 blocks with bfloat16 activations on AVX512_BF16) and
``cpu_sampling.cpp`` (exponential race), next to this file. The first call
builds them with :func:`torch.utils.cpp_extension.load`
(``-O3 -march=native -fno-trapping-math -fopenmp``) into a folder of torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``: :func:`build_directory`) named after the
extension; concurrent builders wait on an advisory lock, so a builder killed mid-build does not leave the next
one waiting forever (:func:`_build`). The library registers the Torch ops ``torch.ops.batchinfer_cpu.*``.
Because ``-march=native`` ties the binary to the CPU, the extension name carries a digest of the CPU's
feature flags, of the compiler flags, of the Python and torch versions and of the sources, so a shared
cache never hands one machine another's build or a stale one.

A later process finds the built library under that name and loads it directly
(:func:`torch.ops.load_library`, a few milliseconds): it neither runs ninja nor takes the baton, so a
worker's start does not wait behind a build of the same sources from another checkout (whose paths
differ and would make ninja rebuild). While another process builds (its baton is present), or when
the direct load fails, the ordinary :func:`~torch.utils.cpp_extension.load` path runs.

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
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DISABLE_ENV = "BATCHINFER_CPU_KERNELS"
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_attention.cpp",
        "cpu_elementwise.cpp",
        "cpu_gemm.cpp",
        "cpu_gemm_bf16.cpp",
        "cpu_kv_store.cpp",
        "cpu_q4.cpp",
        "cpu_q4_bf16.cpp",
        "cpu_sampling.cpp",
        "cpu_varlen_attention.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(name)
    for name in ("cpu_bf16.h", "cpu_exp.h", "cpu_gemm_bf16.h", "cpu_gemm_rows.h", "cpu_lanes.h", "cpu_q4_bf16.h")
]
# NOTE: -fno-trapping-math lets GCC if-convert float comparisons (the clamp of exp_clamped) on AVX2, where it
# would otherwise leave the exp loops of the softmax and SiLU scalar; it only drops the assumption that
# floating-point exceptions are observed, so every value computed is unchanged.
_CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]

_loaded: bool | None = None  # None: not tried yet; False: the build failed


def _cpu_flags_line() -> str:
    """The feature-flags line of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm); "" where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (``avx512_bf16``, ``amx_bf16``, ``amx_tile``, ...);
    empty where the file is unreadable (not Linux)."""
    return frozenset(_cpu_flags_line().partition(":")[2].split())


def build_tag() -> str:
    """Short digest of the machine type, the CPU feature flags (``/proc/cpuinfo``), the compiler flags, the
    Python and torch versions and the sources: names the build and
    anything laid out for it (a cache of weights packed by it)."""
    import torch

    flags = _cpu_flags_line()
    versions = f"{sys.version_info[:2]} {sys.abiflags} torch {torch.__version__}"
    digest = hashlib.sha256(f"{platform.machine()} {flags} {' '.join(_CFLAGS)} {versions}".encode())
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
            name = f"batchinfer_cpu_{build_tag()}"
            build_dir = build_directory(name)
            if not _load_built(build_dir / f"{name}.so"):
                _build(name, build_dir)
            _loaded = True
        except Exception as exc:
            logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", exc)
            _loaded = False
    return _loaded


def _build(name: str, build_dir: Path) -> None:
    """Build the library ``name`` in ``build_dir`` with :func:`torch.utils.cpp_extension.load`, one builder at a
    time.

    torch's baton (the ``lock`` file it creates before building and deletes after) outlives a builder that was
    killed mid-build (an OOM kill, ``kill -9``), and every later process would wait on it forever. So builders
    first take an advisory lock (``flock``) on ``build.flock``, which the kernel drops when its holder dies;
    whoever holds it knows that a ``lock`` still there is a dead builder's, removes it, and builds unless the
    builder it waited for has just finished.
    """
    import fcntl

    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        if _load_built(build_dir / f"{name}.so"):
            return
        load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built: ``$TORCH_EXTENSIONS_DIR/name``, else
    ``$XDG_CACHE_HOME/torch_extensions/name`` (default ``~/.cache/torch_extensions/name``, torch's own
    default root on Linux).

    NOTE: computed here rather than by :func:`torch.utils.cpp_extension.get_default_build_root`, whose
    module imports setuptools (about a second of a worker's start) and is needed only to build.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions")
    return Path(root) / name


def _load_built(library: Path) -> bool:
    """Load an already built ``library`` directly; False when there is none, a build is under way (torch's
    baton file ``lock`` beside it), or it does not load."""
    import torch

    if not library.is_file() or (library.parent / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("C++ CPU kernels at %s did not load (%s); building them again", library, exc)
        return False
    return True


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
