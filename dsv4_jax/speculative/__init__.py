"""Speculative decoding: `generate` (generate.py), its option groups (options.py), the run's static program
(program.py), one round (round.py), its statistics (stats.py), the width scheduler's policy (width_policy.py)
and the on-device loop (loop.py)."""
