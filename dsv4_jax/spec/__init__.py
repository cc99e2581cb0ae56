"""The on-device speculative decoding loop: sampling, verification, statistics, generate()."""
