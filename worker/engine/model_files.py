"""A model folder's ``transformers`` config and tokenizer, as ``AutoConfig``/``AutoTokenizer`` resolve them,
without paying for the resolution at every worker start.

``AutoConfig.from_pretrained`` imports the family's config module, and in transformers 5 that module's import
chain (type validators, activations, hub kernels, checkpoint conversion, ``torch.distributed.tensor``) costs
more CPU than reading the whole config; ``AutoTokenizer.from_pretrained`` calls ``AutoConfig`` first to pick
the tokenizer class. Both results depend only on the folder's ``config.json`` and ``tokenizer_config.json``
and on the transformers version, so the first load writes what they resolved to
``<cache dir>/<digest>.config.json``:

- the config's every instance attribute (defaults filled in by the family's class) and its ``model_type``;
  a later load gives a ``PretrainedConfig`` holding exactly those attributes (the engine reads attributes
  only, never the family class). Values are stored only when they survive the JSON encoding unchanged
  (checked at write time), so a config that does not is simply resolved by ``AutoConfig`` every time;
- the tokenizer class ``AutoTokenizer`` picked; a later load calls that class's ``from_pretrained`` as
  ``AutoTokenizer`` does, which reads the tokenizer files themselves as before.

The digest names this format, the transformers version, the folder's path and both files' bytes, so any
change resolves again. ``tests/worker/engine/test_model_files.py`` checks equality with transformers'
own objects on every served family.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_TOKENIZER_CONFIG = "tokenizer_config.json"


def cache_path(cache_dir: Path, model_dir: Path) -> Path:
    """``cache_dir/<digest>.config.json`` for the folder's current ``config.json`` and ``tokenizer_config.json``."""
    digest = hashlib.sha256(f"{FORMAT_VERSION} {transformers.__version__} {model_dir.resolve()}".encode())
    for name in ("config.json", _TOKENIZER_CONFIG):
        path = model_dir / name
        digest.update(f"{name} {path.read_bytes().hex() if path.is_file() else '-'}".encode())
    return cache_dir / f"{digest.hexdigest()[:24]}.config.json"


def load_config(model_dir: str | Path, cache_dir: str | Path | None = None) -> PretrainedConfig:
    """The folder's config with transformers' values (``AutoConfig.from_pretrained``; cached in ``cache_dir``).

    Raises:
        OSError, ValueError: as ``AutoConfig.from_pretrained`` does (no ``config.json``, an unknown model type).
    """
    model_dir = Path(model_dir)
    cached = _read(cache_dir, model_dir)
    if cached is not None and "config" in cached:
        return _restore_config(cached["config"])
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(model_dir)
    values = _config_values(config)
    if cache_dir is not None and _survives_json(values):
        _write(cache_dir, model_dir, {**(cached or {}), "config": _encode(values)})
    return config


def load_tokenizer(model_dir: str | Path, cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The folder's tokenizer as ``AutoTokenizer.from_pretrained`` builds it (its class cached in ``cache_dir``).

    Raises:
        OSError, ValueError: as ``AutoTokenizer.from_pretrained`` does.
    """
    model_dir = Path(model_dir)
    cached = _read(cache_dir, model_dir)
    module_name, _, class_name = str((cached or {}).get("tokenizer_class", "")).partition(":")
    if module_name.startswith("transformers."):  # NOTE: only transformers' own classes, as AutoTokenizer picks here
        tokenizer_class = getattr(importlib.import_module(module_name), class_name)
        # NOTE: the keyword AutoTokenizer adds for a local folder (its revision and commit hash are None there).
        tokenizer: PreTrainedTokenizerBase = tokenizer_class.from_pretrained(model_dir, _from_auto=True)
        return tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if cache_dir is not None:
        cls = type(tokenizer)
        _write(cache_dir, model_dir, {**(cached or {}), "tokenizer_class": f"{cls.__module__}:{cls.__qualname__}"})
    return tokenizer


def _config_values(config: PretrainedConfig) -> dict[str, Any]:
    return {**vars(config), "model_type": config.model_type}


def _survives_json(values: dict[str, Any]) -> bool:
    try:
        return bool(_decode(json.loads(json.dumps(_encode(values)))) == values)
    except (TypeError, ValueError):  # a value JSON cannot hold (a nested config object, say)
        return False


def _restore_config(encoded: dict[str, Any]) -> PretrainedConfig:
    # NOTE: the attributes as the family's class left them; running __init__ again would re-apply base defaults.
    config = PretrainedConfig.__new__(PretrainedConfig)
    vars(config).update(_decode(encoded))
    return config


def _encode(value: Any) -> Any:
    """JSON-ready form of a config value: dicts with non-string keys, tuples and torch dtypes tagged."""
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: _encode(item) for key, item in value.items()}
        return {"__items__": [[_encode(key), _encode(item)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(item) for item in value]}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"__items__"}:
        return {_decode(key): _decode(item) for key, item in value["__items__"]}
    if value.keys() == {"__tuple__"}:
        return tuple(_decode(item) for item in value["__tuple__"])
    if value.keys() == {"__dtype__"}:
        return getattr(torch, value["__dtype__"])
    return {key: _decode(item) for key, item in value.items()}


def _read(cache_dir: str | Path | None, model_dir: Path) -> dict[str, Any] | None:
    if cache_dir is None:
        return None
    path = cache_path(Path(cache_dir), model_dir)
    try:
        cached: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # NOTE: a cache is never a reason not to start; resolve again
        logger.warning("resolved model files at %s did not load (%s); resolving them again", path, exc)
        return None
    return cached


def _write(cache_dir: str | Path, model_dir: Path, cached: dict[str, Any]) -> None:
    """Write ``cached`` atomically (a reader never sees half a file); errors are logged, not raised."""
    path = cache_path(Path(cache_dir), model_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(cached, out)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("could not cache the resolved model files at %s (%s)", path, exc)
