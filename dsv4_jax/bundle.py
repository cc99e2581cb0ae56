"""The config a public entry point accepts: a `ModelConfig`, or the bundle `load_checkpoint` returns.

A checkpoint that holds drafters loads as `CheckpointConfig(target, mtp_layers, dspark)`: the target's
`ModelConfig` plus what the drafters need to know about themselves (DSpark's block size, noise token and
tap layers come from the checkpoint). Every entry point (`forward`, `generate`, `decode.prefill` /
`extend` / `decode_step` / `verify`) starts with `unbundle`, which also turns the backend choice
(`dsv4_jax.backends`: a `Backends`, "auto", "reference" or "pallas") into concrete implementations, so
traced code only ever sees a plain `ModelConfig` with resolved backends.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import backends as B
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DSparkMeta:
    """Shape-defining DSpark values read from the checkpoint (docs/drafter_math.md §2.1-2.2)."""

    n_stages: int
    n_taps: int
    markov_rank: int
    conf_bias: bool
    block_size: int | None = None
    noise_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Config bundle of a checkpoint holding drafters: the target config plus drafter metadata.

    dspark: the DSparkMeta read from a checkpoint, or a `drafters.dspark.DSparkConfig` (a model built in
    memory); either is what the DSpark drafter's `configure` takes.
    """

    target: ModelConfig
    mtp_layers: int = 0
    dspark: Any = None

    def drafter_meta(self) -> dict[str, Any]:
        """Metadata by drafter name (`dsv4_jax.drafters.registry`), for the drafters present."""
        out: dict[str, Any] = {}
        if self.mtp_layers:
            out["mtp"] = self.mtp_layers
        if self.dspark is not None:
            out["dspark"] = self.dspark
        return out


def unbundle(config: ModelConfig | CheckpointConfig, backends: B.Backends | str | None = None
             ) -> tuple[ModelConfig, dict[str, Any]]:
    """(target ModelConfig with concrete backends, drafter metadata by drafter name).

    backends: None keeps the config's own choice (`config.backends`), else a `Backends` or a name
    ("auto" | "reference" | "pallas"); either way "auto" is resolved here, outside traced code.
    """
    if isinstance(config, CheckpointConfig):
        target, meta = config.target, config.drafter_meta()
    elif isinstance(config, ModelConfig):
        target, meta = config, {}
    else:
        raise TypeError(f"expected a ModelConfig or the CheckpointConfig load_checkpoint returns, got "
                        f"{type(config).__name__}")
    choice = target.backends if backends is None else backends
    return target.with_backends(B.resolve(choice)), meta


def as_bundle(config: ModelConfig | CheckpointConfig) -> CheckpointConfig:
    """The config as a CheckpointConfig (a plain ModelConfig becomes one without drafter metadata)."""
    return config if isinstance(config, CheckpointConfig) else CheckpointConfig(unbundle(config)[0])


def target_config(config: ModelConfig | CheckpointConfig, backends: B.Backends | str | None = None) -> ModelConfig:
    """The target ModelConfig of `config`, backends resolved (see `unbundle`)."""
    return unbundle(config, backends)[0]
