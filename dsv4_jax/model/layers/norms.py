"""RMS norms (docs/model_math.md notation: RMSNorm_w(x) = w ⊙ x / sqrt(mean(x²) + eps), in float32)."""
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """Normalise over the last axis in float32; `weight=None` is the unweighted norm. Returns x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)
