"""Copying a Hugging Face checkpoint into a model whose parameters fuse some of its tensors.

A model describes its layout as Hugging Face tensor name -> (our parameter, first row, rows or ``None``
for the whole parameter): q/k/v or gate/up land in row ranges of one fused weight. `copy_into_layout`
is the one loop every model's ``load_weights`` runs over that layout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

CheckpointLayout = dict[str, tuple[nn.Parameter, int, int | None]]


def copy_into_layout(
    layout: CheckpointLayout, tensors: Iterable[tuple[str, str, torch.Tensor]], *, model_name: str
) -> None:
    """Copy each ``(checkpoint name, layout name, tensor)`` into its place in ``layout`` (converted to the
    parameter's dtype and device), then check that every layout entry came.

    Raises:
        KeyError: on a tensor the layout has no place for (named by its checkpoint name).
        ValueError: on a shape mismatch, or naming the layout entries that never came.
    """
    seen: set[str] = set()
    for checkpoint_name, name, tensor in tensors:
        if name not in layout:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of {model_name}")
        param, start, rows = layout[name]
        dest = param.data if rows is None else param.data.narrow(0, start, rows)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"{checkpoint_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        seen.add(name)
    missing = sorted(layout.keys() - seen)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing)}")
