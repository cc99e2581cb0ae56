"""How XLA:TPU reads routed FP4 experts in decode: one chip, one layer's code stack, 6 routed experts.

Compiles (AOT, libtpu, nothing runs) y = Σ_j x W[e_j]ᵀ for x bf16 [1, K] and an FP4 stack (u8 codes
[E, N, K/2], e8m0 scales [E, N, K/32]) three ways and prints XLA's bytes accessed against what the routed
experts' codes + scales occupy:

    interleave   `quant.dequantize` of each expert's slice (the nibble interleave), then the matmul
    rowmajor     `quant.matmul_codes` (even / odd columns against the nibble planes), codes row-major
    kmajor       the same with codes / scales stored contraction-dim major
                 (`analysis.aot.inputs.k_major`, the AOT programs' placement of routed experts on TPU)

    python experiments/aot_fp4_matvec_probe.py [TOPOLOGY (default v6e:1x1)] [E N K (default 256 256 4096)]
"""
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from dsv4_jax.analysis import libtpu  # noqa: E402
libtpu.set_env()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from dsv4_jax.analysis.aot import chips, inputs  # noqa: E402
from dsv4_jax.ops import quant  # noqa: E402

K_ROUTED = 6


def program(variant: str):
    pick = lambda a, e: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)

    def f(codes, scale, x, idx):
        y = 0
        for j in range(K_ROUTED):
            q = quant.QArray(pick(codes, idx[j]), pick(scale, idx[j]), quant.FP4, x.dtype)
            y = y + (x @ quant.dequantize(q, x.dtype).T if variant == "interleave" else quant.matmul_codes(x, q))
        return y
    return f


def main(argv):
    topo = argv[0] if argv else "v6e:1x1"
    E, N, K = (int(a) for a in argv[1:4]) if len(argv) >= 4 else (256, 256, 4096)
    dev = chips.devices(chips.parse(topo))[:1]
    rep = NamedSharding(Mesh(np.array(dev), ("x",)), PartitionSpec())
    codes = jax.ShapeDtypeStruct((E, N, K // 2), jnp.uint8, sharding=rep)
    scale = jax.ShapeDtypeStruct((E, N, K // 32), jnp.uint8, sharding=rep)
    x = jax.ShapeDtypeStruct((1, K), jnp.bfloat16, sharding=rep)
    idx = jax.ShapeDtypeStruct((K_ROUTED,), jnp.int32, sharding=rep)
    need = K_ROUTED * N * (K // 2 + K // 32)
    print(f"{topo}: E={E} N={N} K={K}; routed codes + scales {need / 2**20:.2f} MiB")
    print(f"{'variant':12s} {'XLA MiB':>9s} {'ratio':>6s} {'compile s':>9s}")
    for v in ("interleave", "rowmajor", "kmajor"):
        c, s = (inputs.k_major(a) for a in (codes, scale)) if v == "kmajor" else (codes, scale)
        t = time.time()
        compiled = jax.jit(program(v)).lower(c, s, x, idx).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        b = float(cost["bytes accessed"])
        print(f"{v:12s} {b / 2**20:9.2f} {b / need:6.2f} {time.time() - t:9.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
