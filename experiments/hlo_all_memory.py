"""HBM bytes vs bytes in every memory space of a compiled program's HLO (`dsv4-aot --hlo-dir` output).

`analysis.aot.hlo.top_ops` counts HBM traffic only (arrays in on-chip memory spaces `S(n)`, TPU VMEM /
SMEM, count 0); XLA's `cost_analysis()` "bytes accessed" counts every memory space. This prints both sums
(while bodies × trip counts) and the largest op groups of the all-memory sum, to see which of XLA's bytes
are on-chip traffic.

    python experiments/hlo_all_memory.py HLO_TEXT [TOP (default 10)]
"""
import sys

from dsv4_jax.analysis.aot import hlo


def all_memory(module: hlo.Module, top: int) -> dict:
    """`hlo.top_ops` with every array counted as if it lived in HBM."""
    real = hlo.arrays
    hlo.arrays = lambda shape: [hlo.Array(a.dtype, a.dims, 0) for a in real(shape)]
    try:
        return hlo.top_ops(module, top, scale_loops=True)
    finally:
        hlo.arrays = real


def main(argv):
    module = hlo.parse(open(argv[0]).read())
    top = int(argv[1]) if len(argv) > 1 else 10
    hbm = hlo.top_ops(module, top, scale_loops=True)
    every = all_memory(module, top)
    print(f"HBM op bytes {hbm['total_bytes'] / 1e9:.3f} GB; all memory spaces {every['total_bytes'] / 1e9:.3f} GB")
    print(f"{'all-memory GB':>13s} {'HBM GB':>7s} {'count':>5s}  group")
    hbm_groups = {g["group"]: g["bytes"] for g in hlo.top_ops(module, 10**6, scale_loops=True)["groups"]}
    for g in every["groups"]:
        print(f"{g['bytes'] / 1e9:13.3f} {hbm_groups.get(g['group'], 0.0) / 1e9:7.3f} {g['count']:5d}  {g['group'][:100]}")


if __name__ == "__main__":
    main(sys.argv[1:])
