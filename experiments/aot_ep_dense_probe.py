"""How XLA:TPU reads a layer-stacked FP4 word expert stack in the EP all-experts local path (verify).

Compiles (AOT, libtpu, nothing runs) a `lax.scan` over L layers whose xs are routed-expert stacks in the
uint32 word layout, k-major as the AOT programs place them (`analysis.aot.inputs.experts_k_major`):
w1 / w3 [L, E, I, D], w2 [L, E, D, I] (E, I, D per chip: the latency preset splits I over 8 chips), and
per layer y = Σ_e cw[:, e] · W2[e] swiglu(W1[e] x, W3[e] x) for x bf16 [T, D] (T = 48: verify of 6 tokens
at B = 8), three ways:

    dequant   the whole stack dequantized as one expression feeding three einsums (main before this step)
    batched   one batched matmul over all experts against the decoded word planes (`quant.word_planes`)
    loop      one `quant.matmul_words` per expert on its slice (the decode slot path, E slots)
    scan      the same as a `lax.fori_loop` over the experts (one body)
    chunkC    `batched` on static chunks of C experts, summed
    package   `moe_ep.experts_dense` as the package has it (= loop since the fifth step)

and prints the HLO-op bytes (`analysis.aot.hlo.top_ops`, loop bodies × trip count) against the words the
layers hold (the bound: every expert read once), XLA's bytes accessed, and the top op groups.

    python experiments/aot_ep_dense_probe.py [TOPOLOGY (v6e:1x1)] [L E I D T (4 256 256 4096 48)]

VARIANTS=a,b (environment) compiles only those; DUMP=DIR writes each variant's HLO text there.
"""
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from dsv4_jax.analysis import libtpu  # noqa: E402
libtpu.set_env()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from dsv4_jax.analysis.aot import chips, hlo, inputs  # noqa: E402
from dsv4_jax.model.layers import moe_ep  # noqa: E402
from dsv4_jax.ops import moe as ops  # noqa: E402
from dsv4_jax.ops import quant  # noqa: E402

K_ROUTED = 6
LIMIT = 10.0
VARIANTS = tuple(os.environ["VARIANTS"].split(",")) if os.environ.get("VARIANTS") else ("dequant", "batched", "loop")


def dequant(x, idx, w, w1, w2, w3):
    """The all-experts path before: every stack dequantized, three einsums."""
    T, E = x.shape[0], w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
    w1, w2, w3 = (quant.dense(m, x.dtype) for m in (w1, w2, w3))
    h = ops.swiglu(jnp.einsum("td,eid->tei", x, w1), jnp.einsum("td,eid->tei", x, w3), LIMIT)
    h = (h.astype(jnp.float32) * cw[..., None]).astype(x.dtype)
    return jnp.einsum("tei,edi->td", h, w2, preferred_element_type=jnp.float32)


def batched_words(x, q):
    """Every expert of a word stack [E, N, K] on x [T, K] or [T, E, K] as one batched matmul against the
    8 decoded nibble planes (`quant.word_planes`) -> float32 [T, E, N]."""
    kw = q.codes.shape[-1]
    g = quant.word_groups(q.fmt, kw * 8)
    planes = quant.word_planes(q, x.dtype)                                            # [8, E, N, g, G/8]
    if x.ndim == 2:
        y = jnp.einsum("tgij,iengj->tein", x.reshape(x.shape[0], g, 8, kw // g), planes,
                       preferred_element_type=jnp.float32)
    else:
        y = jnp.einsum("tegij,iengj->tein", x.reshape(*x.shape[:2], g, 8, kw // g), planes,
                       preferred_element_type=jnp.float32)
    return y.sum(-2)


def batched(x, idx, w, w1, w2, w3):
    """All experts as batched word matmuls (`batched_words`), no per-expert slices."""
    T, E = x.shape[0], w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
    h = ops.swiglu(batched_words(x, w1).astype(x.dtype), batched_words(x, w3).astype(x.dtype), LIMIT)
    h = (h.astype(jnp.float32) * cw[..., None]).astype(x.dtype)
    return batched_words(h, w2).sum(1)


def loop(x, idx, w, w1, w2, w3):
    """One slice + `matmul_words` per expert (the decode slot path with E slots)."""
    T, E = x.shape[0], w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
    pick = lambda q, e: quant.QArray(q.codes[e], q.scale[e], q.fmt, q.dtype)
    y = jnp.zeros((T, w2.shape[1]), jnp.float32)
    for e in range(E):
        h = ops.swiglu(quant.matmul_words(x, pick(w1, e)), quant.matmul_words(x, pick(w3, e)), LIMIT)
        h = (h.astype(jnp.float32) * cw[:, e:e + 1]).astype(x.dtype)
        y = y + quant.matmul_words(h, pick(w2, e)).astype(jnp.float32)
    return y


def chunks(x, idx, w, w1, w2, w3, size):
    """`batched` on static chunks of `size` experts, the partial sums added."""
    E = w1.shape[0]
    cut = lambda q, a: quant.QArray(q.codes[a:a + size], q.scale[a:a + size], q.fmt, q.dtype)
    y = 0
    for a in range(0, E, size):
        sel = (idx >= a) & (idx < a + size)
        y = y + batched(x, jnp.where(sel, idx - a, 0), jnp.where(sel, w, 0.0), cut(w1, a), cut(w2, a), cut(w3, a))
    return y


def scanned(x, idx, w, w1, w2, w3):
    """The per-expert loop as a `lax.fori_loop` over the experts (one loop body, dynamic expert index)."""
    T, E = x.shape[0], w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
    pick = lambda q, e: quant.QArray(jax.lax.dynamic_index_in_dim(q.codes, e, 0, keepdims=False),
                                     jax.lax.dynamic_index_in_dim(q.scale, e, 0, keepdims=False), q.fmt, q.dtype)

    def one(e, y):
        h = ops.swiglu(quant.matmul_words(x, pick(w1, e)), quant.matmul_words(x, pick(w3, e)), LIMIT)
        c = jax.lax.dynamic_slice_in_dim(cw, e, 1, axis=1)
        h = (h.astype(jnp.float32) * c).astype(x.dtype)
        return y + quant.matmul_words(h, pick(w2, e)).astype(jnp.float32)
    return jax.lax.fori_loop(0, E, one, jnp.zeros((T, w2.shape[1]), jnp.float32))


def layer_fn(variant):
    if variant.startswith("chunk"):
        return lambda *a: chunks(*a, int(variant[5:]))
    if variant == "package":
        return lambda x, idx, w, w1, w2, w3: moe_ep.experts_dense(x, idx, w, w1, w2, w3, LIMIT)
    return {"dequant": dequant, "batched": batched, "loop": loop, "scan": scanned}[variant]


def program(variant):
    f = layer_fn(variant)

    def run(x, idx, w, stacks):
        def body(h, p):
            y = f(h, idx, w, *p)
            return (h + y.astype(h.dtype) * 1e-3), None
        return jax.lax.scan(body, x, stacks)[0]
    return run


def check(variant) -> float:
    """max relative error of the variant vs `dequant` on small random FP4 words (CPU, float32)."""
    rng = np.random.default_rng(0)
    T, E, I, D = 5, 3, 256, 256
    ms = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((E, I, D), (E, D, I), (E, I, D))]
    qs = [quant.to_words(quant.quantize(jnp.asarray(m), quant.FP4)) for m in ms]
    x = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
    idx = jnp.asarray(rng.integers(0, E, (T, 2)).astype(np.int32))
    w = jnp.asarray(rng.random((T, 2)).astype(np.float32))
    want = np.asarray(dequant(x, idx, w, *qs))
    got = np.asarray(layer_fn(variant)(x, idx, w, *qs))
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main(argv):
    topo = argv[0] if argv else "v6e:1x1"
    L, E, I, D, T = (int(a) for a in argv[1:6]) if len(argv) >= 6 else (4, 256, 256, 4096, 48)
    dev = chips.devices(chips.parse(topo))[:1]
    rep = NamedSharding(Mesh(np.array(dev), ("x",)), PartitionSpec())
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    def stack(n, k):
        c, s = quant.stored_shapes(quant.FP4_WORDS, (L, E, n, k))
        return quant.QArray(inputs.k_major(sds(c, jnp.uint32)), inputs.k_major(sds(s, jnp.uint32)),
                            quant.FP4_WORDS, jnp.bfloat16)
    stacks = (stack(I, D), stack(D, I), stack(I, D))
    need = 3 * L * E * I * D // 2 * (1 + 1 / 16)          # codes (4 bits) + scales (1 byte per 32)
    args = (sds((T, D), jnp.bfloat16), sds((T, K_ROUTED), jnp.int32), sds((T, K_ROUTED), jnp.float32), stacks)
    print(f"{topo} one chip: L={L} E={E} I={I} D={D} T={T}; words + scales of the layers {need / 1e9:.3f} GB")
    for v in VARIANTS:
        err = check(v)
        t = time.time()
        with tempfile.TemporaryDirectory(prefix="ep_dense_probe_") as d:     # XLA's dump: libtpu cannot
            compiled = jax.jit(program(v)).lower(*args).compile(            # print the scatter offload
                compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True})
            text = open(max(glob.glob(os.path.join(d, "*.after_codegen.txt")), key=os.path.getsize)).read()
        if os.environ.get("DUMP"):
            open(os.path.join(os.environ["DUMP"], f"ep_dense_{v}.hlo.txt"), "w").write(text)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        top = hlo.top_ops(hlo.parse(text), n=6, scale_loops=True)
        ob = top["total_bytes"]
        print(f"{v:8s} HLO-op {ob / 1e9:7.3f} GB ({ob / need:5.2f}x)  XLA {float(cost['bytes accessed']) / 1e9:7.3f} GB"
              f"  rel.err vs dequant {err:.1e}  compile {time.time() - t:6.1f} s", flush=True)
        for g in top["groups"][:6]:
            print(f"    {g['bytes'] / 1e9:8.3f} GB {g['count']:5d}  {g['group'][:90]}")


if __name__ == "__main__":
    main(sys.argv[1:])
