"""Layers the model implementations share: attention over the paged KV cache, linear layers."""
