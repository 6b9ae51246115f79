"""Where heads live and how they are read and written: a small folder beside the model.

``<model folder>/heads/eagle/`` and ``<model folder>/heads/medusa/`` each hold ``config.json`` and
``model.safetensors`` in the published key layouts (:mod:`.eagle`, :mod:`.medusa`), so a folder downloaded from
``yuhuili/EAGLE-*`` or a Medusa repository loads the same way. Published folders may store
``pytorch_model.bin`` (EAGLE) or ``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt`` (Medusa) instead; their
``config.json`` is a Llama config (EAGLE) or has ``medusa_num_heads`` / ``medusa_num_layers`` (Medusa).

A folder may also hold ``draft_vocab.safetensors`` (``token_ids``, LongTensor ``[n]``): the tokens the head drafts
over (:class:`~worker.engine.spec_decode.head_trees.DraftLMHead`), the ``n`` most frequent of its training text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker.engine.spec_decode.heads.eagle import EagleHead, EagleHeadConfig
from worker.engine.spec_decode.heads.medusa import MedusaHeads

HEAD_METHODS = ("eagle", "medusa")
WEIGHT_FILES = ("model.safetensors", "medusa_lm_head.safetensors", "pytorch_model.bin", "medusa_lm_head.pt")
MEDUSA_PREFIX = "medusa_head."
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def default_heads_dir(model_dir: str | Path, method: str) -> Path:
    """``<model_dir>/heads/<method>``, where ``batchinfer heads train`` writes and workers look."""
    return Path(model_dir) / "heads" / method


def save_head(head: EagleHead | MedusaHeads, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32 weights) into ``folder`` (created); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(head, EagleHead):
        config = head.config.to_dict()
        state = head.state_dict()
    else:
        config = {
            "head_type": "medusa",
            "hidden_size": head.hidden_size,
            "medusa_num_heads": head.num_heads,
            "medusa_num_layers": head.num_layers,
        }
        state = head.state_dict()
    tensors = {name: tensor.detach().float().contiguous().cpu() for name, tensor in state.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def save_draft_vocab(folder: str | Path, sequences: list[torch.Tensor], size: int) -> Path:
    """Write the ``size`` most frequent token ids of ``sequences`` (LongTensors) as the folder's draft vocabulary
    (ascending ids; fewer when fewer distinct tokens occur); returns the file."""
    counts = torch.bincount(torch.cat([seq.flatten() for seq in sequences]))
    seen = int((counts > 0).sum())
    top = counts.topk(min(size, seen)).indices.sort().values
    path = Path(folder) / DRAFT_VOCAB_FILE
    save_file({"token_ids": top.to(torch.long).contiguous()}, str(path))
    return path


def load_draft_vocab(folder: str | Path) -> torch.Tensor | None:
    """The folder's draft vocabulary (LongTensor ``[n]``), or None when it has none."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    return load_file(str(path))["token_ids"] if path.is_file() else None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    return load_file(str(path))
                state = torch.load(path, map_location="cpu", weights_only=True)
                return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
            except Exception as exc:  # safetensors' and torch's errors of a truncated or foreign file
                raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    raise FileNotFoundError(f"{folder} holds no head weights (one of {', '.join(WEIGHT_FILES)})")


def load_head(
    folder: str | Path, *, hidden_size: int, dtype: torch.dtype, device: torch.device | str
) -> EagleHead | MedusaHeads:
    """The head stored in ``folder`` (ours or a published EAGLE / Medusa layout), in ``dtype`` on ``device``, eval mode.

    Raises:
        FileNotFoundError: no ``config.json`` or no weights file.
        ValueError: a head whose hidden size is not the target's ``hidden_size``, weights that fit neither layout,
            a ``config.json`` that is not a JSON object or lacks a field the head needs, or a weights file that
            cannot be read (truncated); each names the folder or file.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} holds no head (no config.json)")
    try:
        fields = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    state = _read_weights(folder)
    head: EagleHead | MedusaHeads
    if "fc.weight" in state:
        try:
            config = EagleHeadConfig.from_dict(fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{config_path}: not an EAGLE head's config (a Llama config): {exc!r}") from None
        config.fc_bias = "fc.bias" in state
        config.input_layernorm = "layers.0.input_layernorm.weight" in state
        head = EagleHead(config)
        # Published EAGLE folders may carry the target's embedding; the head uses the target's own.
        state = {key: value for key, value in state.items() if key.startswith(("fc.", "layers.0."))}
    elif "medusa_num_heads" in fields or fields.get("head_type") == "medusa":
        state = {key if key.startswith(MEDUSA_PREFIX) else MEDUSA_PREFIX + key: value for key, value in state.items()}
        num_heads, num_layers = int(fields["medusa_num_heads"]), int(fields.get("medusa_num_layers", 1))
        projection = state.get(f"{MEDUSA_PREFIX}0.{num_layers}.weight")
        head_hidden = int(fields.get("hidden_size") or state[f"{MEDUSA_PREFIX}0.0.linear.weight"].shape[0])
        head = MedusaHeads(
            head_hidden, num_heads, num_layers, vocab_size=None if projection is None else projection.shape[0]
        )
    else:
        raise ValueError(f"{folder}: neither an EAGLE (fc.weight) nor a Medusa (medusa_num_heads) head")
    head_hidden = head.config.hidden_size if isinstance(head, EagleHead) else head.hidden_size
    if head_hidden != hidden_size:
        raise ValueError(f"{folder}: the head's hidden size {head_hidden} is not the target's {hidden_size}")
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{folder}: weights do not fit the head's layout: {exc}") from None
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
