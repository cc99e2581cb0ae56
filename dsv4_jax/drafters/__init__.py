"""Speculative-decoding drafters: MTP (drafters.md §1) and DSpark (drafters.md §2)."""
