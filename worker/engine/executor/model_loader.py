"""Load a Hugging Face folder (``config.json`` + safetensors) into the implementation its architecture names.

Weights stream tensor by tensor from memory-mapped safetensors files, one shard after another, so a
checkpoint never sits in memory twice; each tensor is converted to the engine dtype as it is copied.
A float32 CPU model, once packed, can be cached whole and memory-mapped on later loads
(:mod:`worker.engine.executor.prepared_weights`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.cpu_extension import cpu_kernels_available
from worker.engine.executor.layers.linear import pack_linear_layers
from worker.engine.executor.layers.quantization import check_quantization
from worker.engine.executor.layers.quantization.int8 import quantize_linear_layers
from worker.engine.executor.layers.quantization.q4 import find_gguf, quantize_linear_layers_q4
from worker.engine.executor.models.llama import LlamaForCausalLM, enable_cpu_kernels
from worker.engine.executor.models.registry import resolve_model_class
from worker.engine.executor.prepared_weights import load_prepared, prepared_path, save_prepared
from worker.engine.model_files import load_config

logger = logging.getLogger(__name__)
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, in order: the shards named by ``model.safetensors.index.json`` when
    there is one, else ``model.safetensors``, else every ``*.safetensors`` (sorted).

    NOTE: the index decides, because hub folders may also hold other-format copies of the same weights
    (Mistral's ``consolidated.safetensors``) that would otherwise be read as unexpected tensors.

    Raises:
        FileNotFoundError: if there is no weight file, or the index names a shard that is absent.
    """
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(path) for path in files if not path.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are absent: {', '.join(absent)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, cpu_tensor)`` for every tensor of the checkpoint, shard by shard
    (memory-mapped: a tensor is read when it is yielded)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict: no `in`)
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str = "none",
    prepared_dir: str | Path | None = None,
) -> LlamaForCausalLM:
    """Build the model ``model_dir/config.json``'s ``architectures`` names and load its safetensors weights.

    Stored bf16/fp16/fp32 weights are converted to ``dtype``. Returns the model on ``device``
    in ``dtype``, in ``eval()`` mode with ``requires_grad`` off; a float32 model on CPU gets
    packed-weight linear layers (:func:`worker.engine.executor.layers.linear.pack_linear_layers`; a bfloat16
    one too where the CPU has AVX512_BF16) and fused C++ norms, rotary embeddings and SwiGLU
    (:func:`worker.engine.executor.models.llama.enable_cpu_kernels`). ``quantization="int8"`` first swaps
    every linear layer but the LM head for a weight-only int8 one
    (:func:`worker.engine.executor.layers.quantization.int8.quantize_linear_layers`); ``quantization="q4"``
    swaps the decoder linear layers and the LM head for ones over the blocks of the folder's GGUF file, as the
    file holds them, or over Q4_1 blocks made at load when the folder has no GGUF
    (:func:`worker.engine.executor.layers.quantization.q4.quantize_linear_layers_q4`).

    With ``prepared_dir``, a packed float32 CPU model (no quantization) is cached there after its first
    load and memory-mapped from there on later ones (:mod:`worker.engine.executor.prepared_weights`;
    the same values, without initialising, copying or packing anything); a cache file that does not
    load is logged and replaced.

    Raises:
        FileNotFoundError: if the folder has no safetensors weights.
        UnsupportedModelError: (a ``ValueError``) on an architecture not in
            :data:`~worker.engine.executor.models.registry.MODEL_ARCHITECTURES` (the message lists
            them).
        ValueError: if a weight is missing or mis-shaped (named).
        KeyError: on a checkpoint tensor the model has no parameter for (named).
        ValueError: on a quantization not served, or one this model, dtype or CPU cannot run (named); with
            q4, a GGUF tensor of a type not served or a corrupt GGUF file (named).
    """
    check_quantization(quantization)
    model_dir = Path(model_dir)
    config = load_config(model_dir, prepared_dir)  # NOTE: resolved once per folder (worker/engine/model_files.py)
    model_class = resolve_model_class(config)
    files = safetensors_files(model_dir)  # NOTE: raises before the (possibly large) model is allocated
    cache = None
    if (
        prepared_dir is not None
        and torch.device(device).type == "cpu"
        and dtype == torch.float32
        and quantization == "none"
        and cpu_kernels_available()
    ):
        cache = prepared_path(Path(prepared_dir), model_dir, files, dtype)
    if cache is not None and cache.is_file():
        with torch.device("meta"):
            model = model_class(config)
        try:
            load_prepared(model, cache)
        except Exception as exc:  # NOTE: a cache is never a reason not to start; load from the checkpoint
            logger.warning("prepared weights at %s did not load (%s); preparing them again", cache, exc)
        else:
            model.eval()
            enable_cpu_kernels(model)
            return model
    with torch.device(device):
        model = model_class(config)
    model.to(device=device, dtype=dtype)
    model.load_weights(iter_safetensors(model_dir))
    model.eval()
    model.requires_grad_(False)
    quantized = 0
    if quantization == "int8":
        quantized = quantize_linear_layers(model)
    elif quantization == "q4":
        quantized = quantize_linear_layers_q4(model, find_gguf(model_dir))
    if pack_linear_layers(model) or quantized:  # float32 on CPU (bf16 with AVX512_BF16), kernels built
        enable_cpu_kernels(model)
        if cache is not None:
            save_prepared(model, cache)
    return model
