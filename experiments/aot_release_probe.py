"""Where release-weight EP decode spends its bytes: compile `process_block` of a 5-layer Flash slice (3 + 2
layers) with release weights (FP4 experts, FP8 attention) through a sharding preset for a TPU topology,
print XLA's bytes per chip vs the bound and the compiled HLO's top ops by bytes (`analysis.aot.hlo`).

    python experiments/aot_release_probe.py TOPOLOGY BATCH BLOCK TAG [WEIGHTS [VARIANT]]
    env LOCAL=pallas_tpu: the Mosaic kernels as the EP local matmul; AUTO_LAYOUT=1: the u8 code stacks
    with `Format(Layout.AUTO)` input formats (the program picks their layout). HLO -> /tmp/tpu/TAG.hlo.gz.
"""
import os, sys, time, gzip
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsv4_jax.analysis import libtpu
libtpu.set_env()
import jax, jax.numpy as jnp
import aot_ep_traffic as T
from bench_decode import reduced_flash
from dsv4_jax.analysis.aot import hlo
topo, batch, block, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
weights = sys.argv[5] if len(sys.argv) > 5 else "release"
variant = sys.argv[6] if len(sys.argv) > 6 else "latency"
devs = T.topology_devices(topo)
config = reduced_flash(1)
cfg, mesh, rules = T.variant_setup(variant, config, devs)
local = os.environ.get("LOCAL")
if local:
    import dataclasses
    b = cfg.backends
    cfg = cfg.with_backends(b.replace(ep=dataclasses.replace(b.ep, local=local)))
print("backends", cfg.backends.describe())
args = T.abstract_inputs(cfg, mesh, rules, batch, block, 32768, jnp.bfloat16, T.WEIGHTS[weights])
if os.environ.get("AUTO_LAYOUT"):
    from jax.experimental.layout import Format, Layout
    import numpy as np
    def auto(x):
        if x.dtype == np.uint8 and len(x.shape) >= 3:
            return Format(Layout.AUTO, x.sharding)
        return x.sharding
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
    fn = jax.jit(lambda p, st, tok, nv: T.process_block(p, cfg, st, tok, nv),
                 in_shardings=(jax.tree.map(auto, args[0]), shard(args[1]), shard(args[2]), shard(args[3])))
    t = time.time()
    lowered = fn.lower(*args)
else:
    t = time.time()
    lowered = T.process_block.lower(args[0], cfg, *args[1:])
opts = T.NO_VMEM_MSA.get(topo.split(":")[0])
c = lowered.compile(compiler_options=opts) if opts else lowered.compile()
cost = T._cost(c)
b = T.bounds(config, batch, block, 32768, len(devs), weights)
print(tag, "compile", round(time.time()-t), "s; bytes/chip GiB", cost["bytes accessed"]/2**30, "bound", b["bound"]/2**30,
      "ratio", cost["bytes accessed"]/b["bound"], "bal", cost["bytes accessed"]/b["bound_bal"])
mem = c.memory_analysis(); print("args GiB", mem.argument_size_in_bytes/2**30, "temp", mem.temp_size_in_bytes/2**30, flush=True)
txt = c.as_text()
os.makedirs("/tmp/tpu", exist_ok=True)
with gzip.open(f"/tmp/tpu/{tag}.hlo.gz", "wt") as f: f.write(txt)
a = hlo.analyse(txt, top=25)
for r in a["top_ops"]["ops"]:
    print(f'{r["bytes"]/2**30:8.3f} {r["opcode"]:22s} {r["shape"][:70]:70s} {r["op_name"][-110:]}')
print("hlo total", a["top_ops"]["total_bytes"]/2**30); print("groups")
for r in a["top_ops"]["groups"]:
    print(f'{r["bytes"]/2**30:8.3f} x{r["count"]} {r["group"][-150:]}')
