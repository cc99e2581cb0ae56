#!/usr/bin/env python
"""The converters' command line, runnable from a clone without installing the entry point:

    python convert/dsv4_convert.py hf SRC_DIR OUT_DIR        (= dsv4-convert hf SRC_DIR OUT_DIR)
    python convert/dsv4_convert.py gguf SRC.gguf OUT_DIR

The converters themselves are library code in `dsv4_jax/io/convert/` (docs/converting.md).
"""
import sys

from dsv4_jax.io.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
