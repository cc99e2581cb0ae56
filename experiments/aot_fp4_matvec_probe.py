"""How XLA:TPU reads routed FP4 experts in decode: one chip, one layer's code stack, 6 routed experts.

Compiles (AOT, libtpu, nothing runs) y = Σ_j x W[e_j]ᵀ for x bf16 [1, K] and an FP4 stack (u8 codes
[E, N, K/2], e8m0 scales [E, N, K/32]) several ways and prints XLA's bytes accessed, the HLO-op bytes
(`analysis.aot.hlo.top_ops`) and the copies of a whole code / scale stack in the HLO (re-tiling: in a
sharded program XLA's cost analysis counts them whole) against what the routed experts' codes + scales
occupy:

    interleave   `quant.dequantize` of each expert's slice (the nibble interleave), then the matmul
    rowmajor     `quant.matmul_codes` (even / odd columns against the nibble planes), codes row-major
    kmajor       the same with codes / scales stored contraction-dim major
                 (`analysis.aot.inputs.k_major`, the AOT programs' placement of routed experts on TPU)
    words*       codes as uint32 words, 8 nibbles each (the layout of `quant.to_words`: nibble i of word j
                 is element i·K/8 + j), scales as uint32 words too (byte b of word m: block b·K/128 + m;
                 `_u8s`: u8 scales kept); `_k`: stored k-major. How the 8 nibble planes are contracted:
                   words   one matmul per plane           wordsb  planes broadcast + reshaped to K
                   wordsc  planes concatenated along K    wordse  planes stacked, one einsum over both
                   wordsd  one batched matmul, summed     wordsr  planes stacked along N, block diagonal
    pkg_words    the package's `quant.matmul_codes` on a `quant.FP4_WORDS` QArray (= wordsd)
    u8t          u8 codes stored as [E, K/2, N] arrays (the transpose in the array, not in a layout)

VARIANTS=a,b,... (environment) compiles only those.

    python experiments/aot_fp4_matvec_probe.py [TOPOLOGY (default v6e:1x1)] [E N K (default 256 256 4096)]

With a multi-chip TOPOLOGY the stacks are split over all its chips on the expert axis and the program is
a `shard_map` (each chip: 6 routed experts of its local stack, then a psum), as in the EP decode; bytes
are per chip.
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

from dsv4_jax.analysis.aot import chips, hlo, inputs  # noqa: E402
from dsv4_jax.ops import quant  # noqa: E402

K_ROUTED = 6
VARIANTS = tuple(os.environ["VARIANTS"].split(",")) if os.environ.get("VARIANTS") else ("interleave", "rowmajor", "kmajor", "words_u8s", "words_u8s_k", "words", "words_k", "wordsb", "wordsb_k",
            "wordsb_u8s_k", "wordsc", "wordsc_k", "wordse", "wordse_k", "wordsd", "wordsd_k", "wordsr",
            "wordsr_k", "pkg_words", "pkg_words_k", "u8t")


def pack_words(codes, scale):
    """Probe-local u32 packing (numpy): u8 codes [..., N, K/2], scales [..., N, K/32] -> u32 [..., N, K/8],
    u32 [..., N, K/128] (module docstring)."""
    codes, scale = np.asarray(codes), np.asarray(scale)
    nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1).astype(np.uint32)
    nib = nib.reshape(*nib.shape[:-1], 8, -1)
    cw = sum(nib[..., i, :] << (4 * i) for i in range(8)).astype(np.uint32)
    s = scale.astype(np.uint32).reshape(*scale.shape[:-1], 4, -1)
    sw = sum(s[..., b, :] << (8 * b) for b in range(4)).astype(np.uint32)
    return cw, sw


def matmul_words(x, cw, s):
    """x [..., K] · Wᵀ for u32 code words cw [N, K/8] and scales s (u8 [N, K/32] or u32 words [N, K/128])."""
    kw = cw.shape[-1]
    y = 0
    for i in range(8):
        val = quant.decode_e2m1_float((cw >> (4 * i)) & 0xF)
        if s.dtype == jnp.uint32:
            b = (s[..., (i % 2) * kw // 32:(i % 2 + 1) * kw // 32] >> (8 * (i // 2))) & 0xFF
        else:
            b = s[..., i * kw // 32:(i + 1) * kw // 32]
        sc = jnp.repeat(quant.decode_e8m0(b), 32, axis=-1)
        y = y + x[..., i * kw:(i + 1) * kw] @ (val * sc).astype(x.dtype).T
    return y


def matmul_words_whole(x, cw, s):
    """The same as one matmul: the 8 nibble planes broadcast out of each word and reshaped to the K order
    (plane i, word j -> element i·K/8 + j), the scale bytes likewise (byte b, word m -> block b·K/128 + m)."""
    n, kw = cw.shape
    sh = jnp.arange(8, dtype=jnp.uint32)[:, None]
    val = quant.decode_e2m1_float((cw[..., None, :] >> (4 * sh)) & 0xF).reshape(n, 8 * kw)
    if s.dtype == jnp.uint32:
        s = ((s[..., None, :] >> (8 * sh[:4])) & 0xFF).reshape(n, -1)
    sc = jnp.repeat(quant.decode_e8m0(s), 32, axis=-1)
    return x @ (val * sc).astype(x.dtype).T


def matmul_words_concat(x, cw, s, einsum=False):
    """The same as one matmul over the 8 decoded planes concatenated along K (or, einsum, contracted over
    (plane, word) of x [.., 8, K/8] without a reshape)."""
    n, kw = cw.shape
    planes = []
    for i in range(8):
        val = quant.decode_e2m1_float((cw >> (4 * i)) & 0xF)
        b = (s[..., (i % 2) * kw // 32:(i % 2 + 1) * kw // 32] >> (8 * (i // 2))) & 0xFF
        planes.append((val * jnp.repeat(quant.decode_e8m0(b), 32, axis=-1)).astype(x.dtype))
    if einsum:
        return jnp.einsum("...ij,inj->...n", x.reshape(*x.shape[:-1], 8, kw), jnp.stack(planes))
    return x @ jnp.concatenate(planes, axis=-1).T


def planes_words(cw, s, dtype):
    """Scaled planes [8, N, K/8] of u32 code words [N, K/8] and u32 scale words [N, K/128], one broadcast
    expression (plane i = nibble i; its scales byte i // 2 of words (i % 2)·K/256 ...)."""
    n, kw = cw.shape
    i = jax.lax.broadcasted_iota(jnp.uint32, (8, 1, 1), 0)
    val = quant.decode_e2m1_float((cw[None] >> (4 * i)) & 0xF)                       # [8, N, kw]
    sb = s.reshape(n, 2, kw // 32).transpose(1, 0, 2)                               # [2, N, kw/32]
    b = (jnp.tile(sb, (4, 1, 1)) >> (8 * (i // 2))) & 0xFF                          # plane i: half i % 2
    return (val * jnp.repeat(quant.decode_e8m0(b), 32, axis=-1)).astype(dtype)


def matmul_words_batched(x, cw, s, rows=False):
    """Σ_i x_i P_iᵀ as one batched matmul over the planes (or, rows, one matmul of the 8 x slices against
    the planes stacked along N, keeping the block diagonal)."""
    n, kw = cw.shape
    p = planes_words(cw, s, x.dtype)
    xi = x.reshape(*x.shape[:-1], 8, kw)
    if rows:
        z = xi @ p.reshape(8 * n, kw).T                                               # [.., 8, 8N]
        return jnp.einsum("...iin->...n", z.reshape(*z.shape[:-1], 8, n))
    return jnp.einsum("...ij,inj->...in", xi, p).sum(-2)


def program(variant: str):
    pick = lambda a, e: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)

    def f(codes, scale, x, idx):
        y = 0
        for j in range(K_ROUTED):
            c, s = pick(codes, idx[j]), pick(scale, idx[j])
            if variant.startswith("pkg"):                  # the package's word layout: quant.matmul_codes
                y = y + quant.matmul_codes(x, quant.QArray(c, s, quant.FP4_WORDS, x.dtype))
                continue
            if variant.startswith("wordsd") or variant.startswith("wordsr"):
                y = y + matmul_words_batched(x, c, s, variant.startswith("wordsr"))
                continue
            if variant.startswith("wordsc") or variant.startswith("wordse"):
                y = y + matmul_words_concat(x, c, s, variant.startswith("wordse"))
                continue
            if variant.startswith("wordsb"):
                y = y + matmul_words_whole(x, c, s)
                continue
            if variant.startswith("words"):
                y = y + matmul_words(x, c, s)
                continue
            if variant == "u8t":
                c, s = c.T, s.T
            q = quant.QArray(c, s, quant.FP4, x.dtype)
            y = y + (x @ quant.dequantize(q, x.dtype).T if variant == "interleave" else quant.matmul_codes(x, q))
        return y
    return f


def inputs_of(variant, E, N, K, rep):
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    if variant.startswith("words") or variant.startswith("pkg"):
        c = sds((E, N, K // 8), jnp.uint32)
        s = sds((E, N, K // 32), jnp.uint8) if "u8s" in variant else sds((E, N, K // 128), jnp.uint32)
    elif variant == "u8t":
        c, s = sds((E, K // 2, N), jnp.uint8), sds((E, K // 32, N), jnp.uint8)
    else:
        c, s = sds((E, N, K // 2), jnp.uint8), sds((E, N, K // 32), jnp.uint8)
    if variant == "kmajor" or variant.endswith("_k"):
        c, s = inputs.k_major(c), inputs.k_major(s)
    return c, s


def stack_copies(text: str, stacks) -> int:
    """Instructions (any computation, fusions included) that write a whole code / scale stack."""
    dims = {",".join(str(d) for d in a.shape) for a in stacks}
    n = 0
    for line in text.splitlines():
        ins = hlo.parse_instruction(line)
        if ins is not None and ins.opcode != "parameter":
            if any(f"[{d}]" in ins.shape for d in dims):
                n += 1
    return n


def check_words(seed: int = 0, N: int = 16, K: int = 256) -> float:
    """max |matmul_words − matmul_codes| on random codes / scales, float32 (numpy reference, CPU)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scale = rng.integers(118, 136, (N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((3, K)).astype(np.float32)
    cw, sw = pack_words(codes, scale)
    with jax.default_device(jax.devices("cpu")[0]):
        ref = quant.matmul_codes(jnp.asarray(x), quant.QArray(jnp.asarray(codes), jnp.asarray(scale), quant.FP4))
        dense = np.asarray(quant.dequantize(quant.QArray(jnp.asarray(codes), jnp.asarray(scale), quant.FP4)))
        got = [f(jnp.asarray(x), jnp.asarray(cw), jnp.asarray(s)) for s in (sw, scale)
               for f in (matmul_words, matmul_words_whole)]
        got += [matmul_words_concat(jnp.asarray(x), jnp.asarray(cw), jnp.asarray(sw), e) for e in (False, True)]
        got += [matmul_words_batched(jnp.asarray(x), jnp.asarray(cw), jnp.asarray(sw), r) for r in (False, True)]
    err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(ref)))) for g in got)
    err_np = max(float(np.max(np.abs(np.asarray(g) - x @ dense.T))) for g in got)
    return max(err, err_np) / max(1.0, float(np.max(np.abs(ref))))


def main(argv):
    topo = argv[0] if argv else "v6e:1x1"
    E, N, K = (int(a) for a in argv[1:4]) if len(argv) >= 4 else (256, 256, 4096)
    err = check_words()
    print(f"words vs matmul_codes / numpy dequantize (f32, random codes): max rel err {err:.2e}")
    assert err <= 1e-6, err
    dev = chips.devices(chips.parse(topo))
    mesh = Mesh(np.array(dev), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec("x"))
    x = jax.ShapeDtypeStruct((1, K), jnp.bfloat16, sharding=rep)
    idx = jax.ShapeDtypeStruct((K_ROUTED,), jnp.int32, sharding=rep)
    need = K_ROUTED * N * (K // 2 + K // 32)
    print(f"{topo} ({len(dev)} chip(s), experts split over them): E={E} N={N} K={K}; routed codes + scales "
          f"{need / 2**20:.2f} MiB per chip")
    print(f"{'variant':12s} {'XLA MiB':>9s} {'ratio':>6s} {'op MiB':>8s} {'op ratio':>8s} {'stack copies':>12s} "
          f"{'compile s':>9s}")
    for v in VARIANTS:
        c, s = inputs_of(v, E, N, K, split)
        t = time.time()
        fn = program(v)
        if len(dev) > 1:
            body = lambda *a: jax.lax.psum(program(v)(*a), "x")
            fn = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("x"), PartitionSpec("x"), PartitionSpec(),
                                                          PartitionSpec()), out_specs=PartitionSpec())
        compiled = jax.jit(fn).lower(c, s, x, idx).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        b = float(cost["bytes accessed"])
        text = compiled.as_text()
        ob = hlo.top_ops(hlo.parse(text))["total_bytes"]
        c, s = (jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype) for a in (c, s))
        if os.environ.get("DUMP"):
            open(f"/tmp/fp4probe_{v}.hlo", "w").write(text)
        print(f"{v:12s} {b / 2**20:9.2f} {b / need:6.2f} {ob / 2**20:8.2f} {ob / need:8.2f} "
              f"{stack_copies(text, (c, s)):12d} {time.time() - t:9.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
