"""Training the tiny demo target and its drafters with optax (see experiments/train_tiny.py)."""
