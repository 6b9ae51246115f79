"""A cache of a model's weights as the engine runs them: packed, fused, float32, in one safetensors file.

Loading a float32 CPU model from its Hugging Face folder allocates and initialises every parameter,
copies the checkpoint into them (fusing q/k/v and gate/up) and packs every linear weight into the
kernels' panel layout (:func:`worker.engine.executor.layers.linear.pack_linear_layers`): seconds of
CPU at each worker start for a result that is the same every time. The first load writes that result
(every parameter and buffer of the prepared model) to ``<cache dir>/<digest>.safetensors``; later
loads build the module tree on the meta device and point it at the file's tensors, which safetensors
memory-maps: nothing is computed or copied, pages are read when first touched, and workers on one
machine share them through the page cache.

The digest (:func:`prepared_path`) names what the tensors depend on: this format, the model folder's
path, its ``config.json`` and weight files (size and modification time), the dtype, and the kernels'
build tag (:func:`kernels.cpu_extension.build_tag`: CPU flags, sources, torch version; the panel width
follows the CPU). A changed checkpoint or kernel build therefore gets a new file; the file name starts
with a short hash of the model folder and dtype alone, so writing it removes that folder's stale files
(each about the size of the float32 model) and other models' files stay. Files are written to a
temporary name and renamed, so a reader never sees half a file. The values are bit-identical to a fresh
load (``tests/worker/engine/executor/test_prepared_weights.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kernels.cpu_extension import build_tag
from worker.engine.executor.layers.linear import PackedLinear

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_ALIASES_KEY = "aliases"  # metadata: JSON {name: name of the tensor it shares}


def prepared_path(cache_dir: Path, model_dir: Path, weight_files: list[Path], dtype: torch.dtype) -> Path:
    """``cache_dir/<model key>-<digest>.safetensors`` for this checkpoint, dtype and kernel build (see the
    module docstring). Call only when the C++ kernels are loaded (the build tag names them)."""
    model_key = hashlib.sha256(f"{model_dir.resolve()} {dtype}".encode()).hexdigest()[:8]
    digest = hashlib.sha256(f"{FORMAT_VERSION} {model_dir.resolve()} {dtype} {build_tag()}".encode())
    digest.update((model_dir / "config.json").read_bytes())
    for path in weight_files:
        stat = path.stat()
        digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return cache_dir / f"{model_key}-{digest.hexdigest()[:24]}.safetensors"


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) by qualified name, shared ones under each name."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def save_prepared(model: nn.Module, path: Path) -> None:
    """Write every tensor of the prepared ``model`` to ``path`` (atomically); a tensor shared under
    several names is stored once. Errors are logged, not raised: the cache only saves time."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in _tensors(model):
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key in first_name:
            aliases[name] = first_name[key]
        else:
            first_name[key] = name
            tensors[name] = tensor.detach().contiguous()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, staging, metadata={_ALIASES_KEY: json.dumps(aliases)})
            os.chmod(staging, 0o644)
            os.replace(staging, path)
            model_key = path.name.split("-", 1)[0]
            for stale in path.parent.glob(f"{model_key}-*.safetensors"):
                if stale != path:
                    stale.unlink(missing_ok=True)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    except (OSError, RuntimeError, ValueError) as exc:
        logger.warning("could not cache the prepared weights at %s (%s); the next start prepares them again", path, exc)


def load_prepared(model: nn.Module, path: Path) -> None:
    """Point ``model`` (built on the meta device, unpacked) at the tensors of ``path``, in place.

    Every ``nn.Linear`` whose packed weight the file holds becomes a
    :class:`~worker.engine.executor.layers.linear.PackedLinear` over it; then every parameter and buffer
    is replaced by the file's memory-mapped tensor of that name (parameters without ``requires_grad``).

    Raises:
        ValueError: the file does not hold every tensor of the model, or holds one it has no place for.
        OSError, safetensors.SafetensorError: the file cannot be read.
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        aliases: dict[str, str] = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    tensors = load_file(path)
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            packed = tensors.get(f"{parent_name}.{child_name}.packed_weight".lstrip("."))
            if isinstance(child, nn.Linear) and packed is not None:
                setattr(parent, child_name, PackedLinear(child, packed_weight=packed))
    parameters: dict[str, nn.Parameter] = {}
    names = {name for name, _ in _tensors(model)}
    unknown = (tensors.keys() | aliases.keys()) - names
    if unknown:
        raise ValueError(f"{path}: tensors the model has no place for: {', '.join(sorted(unknown)[:5])}")
    for name in sorted(names):
        source = aliases.get(name, name)
        if source not in tensors:
            raise ValueError(f"{path}: no tensor {name!r}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            if source not in parameters:
                parameters[source] = nn.Parameter(tensors[source], requires_grad=False)
            module._parameters[attr] = parameters[source]
        else:
            module._buffers[attr] = tensors[source]
