"""Output processing: incremental detokenization and stop checking."""
