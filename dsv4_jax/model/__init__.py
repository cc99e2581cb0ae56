"""Pure functions of the DeepSeek-V4 target model, one concern per module."""
from .target import embed, forward, head, hidden_states, run_segments

__all__ = ["embed", "forward", "head", "hidden_states", "run_segments"]
