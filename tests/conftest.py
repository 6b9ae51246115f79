"""Shared pytest set-up: one torch thread (CI has 2 cores shared with Postgres and Redis); Triton's
interpreter where there is no CUDA device."""

import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# NOTE: Triton reads TRITON_INTERPRET once, when it is first imported, and transformers may import it
# before any Triton test does; set here, before any test module loads, the kernels run in the
# interpreter on a machine without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
