"""Speculative decoding: `generate` (generate.py), its option groups (options.py) and the on-device loop (loop.py)."""
