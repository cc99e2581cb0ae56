"""Batch evaluation (thin wrapper of `dsv4-batch-eval`; see `python experiments/batch_eval.py --help`)."""
import sys

from dsv4_jax.research.batch_eval import main

if __name__ == "__main__":
    sys.exit(main())
