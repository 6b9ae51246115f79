"""Logits operations of the sampler: penalties and biases, top-k / top-p / min-p truncation."""
