"""CPU kernels (paged attention over the KV cache, packed-weight fp32 GEMM) built on first use by ``cpu_extension``;
``reference`` holds their plain PyTorch twins. Imports nothing of ours."""
