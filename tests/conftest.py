"""Shared pytest set-up: one torch thread (CI has 2 cores shared with Postgres and Redis)."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch
except ImportError:  # pragma: no cover - torch is a hard dependency; keep collection alive if absent
    torch = None
if torch is not None:
    torch.set_num_threads(1)
