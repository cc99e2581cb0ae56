"""Checkpoint readers and converters (installed as `dsv4_jax.io.convert`)."""
