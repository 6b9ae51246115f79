"""Attention over the paged KV cache: per-step metadata, the paged path and cascade (shared-prefix) attention."""
