"""Speculative decoding: draft proposers, the automatic policy and the per-step glue (docs/engine.md,
"Speculative decoding"). The acceptance rule lives in ``sample/rejection_sampler.py``."""
