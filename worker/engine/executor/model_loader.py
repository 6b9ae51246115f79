"""Load a Hugging Face Llama folder (``config.json`` + ``*.safetensors``) into our :class:`LlamaForCausalLM`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, LlamaConfig

from worker.engine.executor.layers.linear import pack_linear_layers
from worker.engine.executor.models.llama import LlamaForCausalLM


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, cpu_tensor)`` for every tensor of every ``*.safetensors`` file, sorted by file."""
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict: no `in`)
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """Build the model from ``model_dir/config.json`` and load its safetensors weights.

    Returns the model on ``device`` in ``dtype``, in ``eval()`` mode with ``requires_grad`` off; a
    float32 model on CPU gets packed-weight linear layers (:func:`worker.engine.executor.layers.linear.pack_linear_layers`).

    Raises:
        FileNotFoundError: if the folder has no ``*.safetensors`` file.
        ValueError: if the config is not a Llama config, or a weight is missing or mis-shaped.
        KeyError: on a checkpoint tensor the model has no parameter for.
    """
    model_dir = Path(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    config = AutoConfig.from_pretrained(model_dir)
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"{model_dir}: expected a Llama config, got {type(config).__name__}")
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(device=device, dtype=dtype)
    model.load_weights(iter_safetensors(model_dir))
    model.eval()
    model.requires_grad_(False)
    pack_linear_layers(model)
    return model
