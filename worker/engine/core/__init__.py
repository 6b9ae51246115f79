"""The scheduling core (pure Python, no torch): block pool, KV cache manager, requests and sequences, scheduler."""
