"""Load a Hugging Face folder (``config.json`` + safetensors) into the implementation its architecture names.

Weights stream tensor by tensor from memory-mapped safetensors files, one shard after another, so a
checkpoint never sits in memory twice; each tensor is converted to the engine dtype as it is copied.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from worker.engine.executor.layers.linear import pack_linear_layers
from worker.engine.executor.layers.quantization import check_quantization
from worker.engine.executor.layers.quantization.int8 import quantize_linear_layers
from worker.engine.executor.layers.quantization.q4 import find_gguf, quantize_linear_layers_q4
from worker.engine.executor.models.llama import LlamaForCausalLM, enable_cpu_kernels
from worker.engine.executor.models.registry import resolve_model_class

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
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
) -> LlamaForCausalLM:
    """Build the model ``model_dir/config.json``'s ``architectures`` names and load its safetensors weights.

    Stored bf16/fp16/fp32 weights are converted to ``dtype``. Returns the model on ``device``
    in ``dtype``, in ``eval()`` mode with ``requires_grad`` off; a float32 model on CPU gets
    packed-weight linear layers (:func:`worker.engine.executor.layers.linear.pack_linear_layers`) and
    fused C++ norms, rotary embeddings and SwiGLU
    (:func:`worker.engine.executor.models.llama.enable_cpu_kernels`). ``quantization="int8"`` first swaps
    every linear layer but the LM head for a weight-only int8 one
    (:func:`worker.engine.executor.layers.quantization.int8.quantize_linear_layers`); ``quantization="q4"``
    swaps the decoder linear layers and the LM head for ones over the blocks of the folder's GGUF file, as the
    file holds them, or over Q4_1 blocks made at load when the folder has no GGUF
    (:func:`worker.engine.executor.layers.quantization.q4.quantize_linear_layers_q4`).

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
    config = AutoConfig.from_pretrained(model_dir)
    model_class = resolve_model_class(config)
    safetensors_files(model_dir)  # NOTE: raises before the (possibly large) model is allocated
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
    if pack_linear_layers(model) or quantized:  # float32 on CPU, kernels built
        enable_cpu_kernels(model)
    return model
