"""Attention kernels over the paged KV cache; ``reference`` holds their plain PyTorch twins. Imports nothing of ours."""
