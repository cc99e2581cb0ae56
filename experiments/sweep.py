"""Speculative-decoding sweep (thin wrapper of `dsv4-sweep`; see `python experiments/sweep.py --help`)."""
import sys

from dsv4_jax.research.sweep import main

if __name__ == "__main__":
    sys.exit(main())
