"""Sampling: the sampler and the logits operations it applies."""
