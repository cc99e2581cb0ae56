"""dsv4-aot: HLO reading, topology names, the libtpu-missing message, and CPU-backend compiles of tiny
configs through the report's code path (every layer counted; report files written). One slow test runs the
same path through libtpu for a TPU topology."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config as C, parallel
from dsv4_jax.analysis import libtpu, traffic
from dsv4_jax.model import params as P
from dsv4_jax.ops import quant
from dsv4_jax.parallel import expert_words
from dsv4_jax.parallel.expert_words import shard_group
from jax.experimental.layout import Format
from dsv4_jax.analysis.aot import bounds as AB, chips, cli, compile as AC, ep as EP, extrapolate as X, hlo, inputs as I, programs as PR, report as R, runner
from dsv4_jax.analysis.aot import fit_summary as FS, placement_table as PT

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- HLO text --------------------------------------------------------------------------------------

SAMPLE = """HloModule jit_step, is_scheduled=true, num_partitions=4

%fused_slice (param_0: bf16[64,512,1024], param_1: s32[]) -> bf16[1,512,1024] {
  %param_0 = bf16[64,512,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-slice.1 = bf16[1,512,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %constant.1, %constant.1), dynamic_slice_sizes={1,512,1024}
}

%fused_update (param_0.1: bf16[8,128,512], param_1.1: bf16[8,1,512], param_2.1: s32[]) -> bf16[8,128,512] {
  %param_0.1 = bf16[8,128,512]{2,1,0} parameter(0)
  %param_1.1 = bf16[8,1,512]{2,1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %constant.2 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = bf16[8,128,512]{2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %constant.2, %param_2.1, %constant.2)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p.1: (s32[], f32[4096])) -> (s32[], f32[4096]) {
  %p.1 = (s32[], f32[4096]{0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%p.1), index=0
  %gte.1 = f32[4096]{0} get-tuple-element(%p.1), index=1
  %negate.1 = f32[4096]{0} negate(%gte.1), metadata={op_name="jit(step)/while/body/neg"}
  ROOT %tuple.1 = (s32[], f32[4096]{0}) tuple(%gte.0, %negate.1)
}

%cond (p.2: (s32[], f32[4096])) -> pred[] {
  %p.2 = (s32[], f32[4096]{0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%p.2), index=0
  %constant.3 = s32[] constant(10)
  ROOT %lt = pred[] compare(%gte.2, %constant.3), direction=LT
}

ENTRY %main.9 (w: bf16[64,512,1024], i: s32[], cache: bf16[8,128,512], row: bf16[8,1,512], x: f32[4096]) -> f32[4096] {
  %w = bf16[64,512,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %cache = bf16[8,128,512]{2,1,0} parameter(2)
  %row = bf16[8,1,512]{2,1,0} parameter(3)
  %x = f32[4096]{0} parameter(4)
  %fusion = bf16[1,512,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/jit(main)/layer_17/dynamic_slice" source_line=3}
  %fusion.1 = bf16[8,128,512]{2,1,0} fusion(%cache, %row, %i), kind=kLoop, calls=%fused_update, metadata={op_name="jit(step)/update_cache"}
  %all-reduce = f32[4096]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %all-gather = f32[16384]{0} all-gather(%x), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %collective-permute-start = (f32[4096]{0}, f32[4096]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[4096]{0} collective-permute-done(%collective-permute-start)
  %reduce-scatter = f32[1024]{0} reduce-scatter(%x), channel_id=4, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %all-to-all = bf16[4,2,64]{2,1,0} all-to-all(%row), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=1] {'axis_0','axis_1'}, dimensions={0}
  %copy-start = (f32[4096]{0:S(1)}, f32[4096]{0}, u32[]) copy-start(%x)
  %copy-done = f32[4096]{0:S(1)} copy-done(%copy-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4096]{0}) tuple(%zero, %x)
  %while = (s32[], f32[4096]{0}) while(%init), condition=%cond, body=%body
  ROOT %gte.3 = f32[4096]{0} get-tuple-element(%while), index=1
}
"""


def test_hlo_bytes_per_op():
    """Bytes by hand: a fusion reading one [1,512,1024] bf16 slice of a [64,512,1024] weight reads 1 MiB (+ the
    4-byte index) and writes 1 MiB; an in-place cache update reads and writes only its row [8,1,512]; a copy
    into on-chip memory (S(1)) writes no HBM; while bodies are executed computations, fusion bodies not."""
    m = hlo.parse(SAMPLE)
    assert m.entry.name == "main.9"
    rows = {r["name"]: r for r in hlo.top_ops(m, 50)["ops"]}
    mib = 512 * 1024 * 2
    assert rows["fusion"]["bytes"] == 2 * mib + 4
    assert rows["fusion"]["group"] == "layer_#/dynamic_slice"
    assert rows["fusion.1"]["bytes"] == 2 * 8 * 512 * 2 + 4
    assert rows["all-reduce"]["bytes"] == 2 * 4096 * 4
    assert rows["all-gather"]["bytes"] == 4096 * 4 + 16384 * 4
    assert rows["collective-permute-start"]["bytes"] == 2 * 4096 * 4       # operand + output, aliases not again
    assert rows["copy-start"]["bytes"] == 4096 * 4                          # HBM read, VMEM write
    assert rows["negate.1"]["bytes"] == 2 * 4096 * 4                        # inside the while body
    assert "dynamic-slice.1" not in rows and "collective-permute-done" not in rows and "gte.3" not in rows


RELAYOUT = """HloModule jit_step, is_scheduled=true

%copy_fusion (input: s8[20,4096,1024]) -> s8[20,4096,1024] {
  %input = s8[20,4096,1024]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy = s8[20,4096,1024]{2,1,0:T(8,128)(4,1)} copy(%input)
}

%fused_dot (param_0: s8[20,4096,1024], param_1: s32[]) -> f32[4096] {
  %param_0 = s8[20,4096,1024]{2,1,0:T(32,128)(4,1)} parameter(0)
  %param_1 = s32[] parameter(1)
  %fusion.2 = s8[20,4096,1024]{2,1,0:T(8,128)(4,1)} fusion(%param_0), kind=kLoop, calls=%copy_fusion
  %constant.1 = s32[] constant(0)
  %dynamic-slice.1 = s8[1,4096,1024]{2,1,0} dynamic-slice(%fusion.2, %param_1, %constant.1, %constant.1), dynamic_slice_sizes={1,4096,1024}
  %convert.1 = f32[1,4096,1024]{2,1,0} convert(%dynamic-slice.1)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.1 = f32[4096]{0} reduce(%convert.1, %constant.2), dimensions={0,2}, to_apply=%add
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (w: s8[20,4096,1024], i: s32[]) -> (f32[4096], s8[4194304]) {
  %w = s8[20,4096,1024]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[] parameter(1)
  %fusion = f32[4096]{0} fusion(%w, %i), kind=kLoop, calls=%fused_dot
  %flat = s8[83886080]{0} bitcast(%w)
  %slice-start = ((s8[83886080]{0}), s8[4194304]{0}, s32[]) slice-start(%flat), slice={[0:4194304]}
  %slice-done = s8[4194304]{0} slice-done(%slice-start)
  ROOT %out = (f32[4096]{0}, s8[4194304]{0}) tuple(%fusion, %slice-done)
}
"""


def test_hlo_bytes_through_relayout_and_async_slice():
    """A layer's slice of an 8-bit stack read through a nested re-tiling copy fusion (XLA:TPU's copy_fusion,
    computed per element inside the fusion) or sliced inside a nested fusion counts the slice, 4 MiB of the
    80 MiB stack (+ 4 index bytes, + 16 KiB written); an async slice-start reads and writes its 4 MiB slice."""
    rows = {r["name"]: r for r in hlo.top_ops(hlo.parse(RELAYOUT), 50)["ops"]}
    assert rows["fusion"]["bytes"] == 4096 * 1024 + 4 + 4096 * 4
    assert rows["slice-start"]["bytes"] == 2 * 4096 * 1024
    whole = RELAYOUT.replace("%copy = s8[20,4096,1024]{2,1,0:T(8,128)(4,1)} copy(%input)",
                             "%copy = s8[20,4096,1024]{2,1,0:T(8,128)(4,1)} negate(%input)")
    assert hlo.top_ops(hlo.parse(whole), 50)["ops"][0]["bytes"] == 20 * 4096 * 1024 + 4 + 4096 * 4
    nested = """HloModule jit_step, is_scheduled=true

%slice_fusion (input: s8[20,4096,1024], j: s32[]) -> s8[4096,1024] {
  %input = s8[20,4096,1024]{2,1,0} parameter(0)
  %j = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = s8[1,4096,1024]{2,1,0} dynamic-slice(%input, %j, %c, %c), dynamic_slice_sizes={1,4096,1024}
  ROOT %bc = s8[4096,1024]{1,0} bitcast(%ds)
}

%fused (param_0: s8[20,4096,1024], param_1: s32[]) -> f32[4096,1024] {
  %param_0 = s8[20,4096,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %fusion.2 = s8[4096,1024]{1,0} fusion(%param_0, %param_1), kind=kLoop, calls=%slice_fusion
  ROOT %convert.1 = f32[4096,1024]{1,0:S(1)} convert(%fusion.2)
}

ENTRY %main (w: s8[20,4096,1024], i: s32[]) -> f32[4096,1024] {
  %w = s8[20,4096,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %fusion = f32[4096,1024]{1,0:S(1)} fusion(%w, %i), kind=kLoop, calls=%fused
}
"""
    assert hlo.top_ops(hlo.parse(nested), 5)["ops"][0]["bytes"] == 4096 * 1024 + 4     # a nested fusion's slice


ASYNC_OFFLOADS = """HloModule jit_step, is_scheduled=true

%async_computation.1 (p: s8[33554432]) -> s8[4194304] {
  %p = s8[33554432]{0:T(1024)(128)(4,1)} parameter(0)
  ROOT %slice.1 = s8[4194304]{0:T(1024)(128)(4,1)S(1)} slice(%p), slice={[4194304:8388608]}
}

%gather_body (t: bf16[1,20,8194,512], ix: s32[3072]) -> bf16[3072,512] {
  %t = bf16[1,20,8194,512]{3,2,1,0} parameter(0)
  %ix = s32[3072]{0} parameter(1)
  %gather_offload_custom_fusion.1.call-start = ((bf16[1,20,8194,512]{3,2,1,0}, s32[3072]{0}), bf16[3072,512]{1,0}, u32[]{:S(8)}) async-start(%t, %ix), calls=%async_computation.1
  ROOT %gather_offload_custom_fusion.1.call-done = bf16[3072,512]{1,0} async-done(%gather_offload_custom_fusion.1.call-start)
}

ENTRY %main (w: s8[33554432], cache: bf16[1,20,8194,512], ix: s32[3072]) -> (s8[4194304], bf16[3072,512], bf16[3072,512]) {
  %w = s8[33554432]{0:T(1024)(128)(4,1)} parameter(0)
  %cache = bf16[1,20,8194,512]{3,2,1,0} parameter(1)
  %ix = s32[3072]{0} parameter(2)
  %slice-start.1 = ((s8[33554432]{0:T(1024)(128)(4,1)}), s8[4194304]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) async-start(%w), calls=%async_computation.1
  %slice-done.1 = s8[4194304]{0:T(1024)(128)(4,1)S(1)} async-done(%slice-start.1)
  %gather_offload_async_start = ((), (), (s32[16384]{0})) async-start()
  %gather_offload_async_start.update = ((bf16[1,20,8194,512]{3,2,1,0}, s32[3072]{0}), bf16[3072,512]{1,0}, (s32[16384]{0})) async-update(%gather_offload_async_start, %cache, %ix)
  %gather_offload_async_done = bf16[3072,512]{1,0} async-done(%gather_offload_async_start.update)
  %custom-call.1 = bf16[3072,512]{1,0} custom-call(%cache, %ix), custom_call_target="TODO", called_computations={%gather_body}
  ROOT %out = (s8[4194304]{0:S(1)}, bf16[3072,512]{1,0}, bf16[3072,512]{1,0}) tuple(%slice-done.1, %gather_offload_async_done, %custom-call.1)
}
"""


def test_hlo_bytes_of_async_slice_and_sparsecore_gather():
    """XLA:TPU's async copy of a slice of a weight buffer into VMEM (`async-start` calling a slice) reads its
    4 MiB slice, not the 32 MiB buffer; a SparseCore gather offload (its async-update, or the custom-call
    wrapping it) reads and writes the 3072 rows it returns and reads its indices, not the 168 MB cache."""
    rows = {r["name"]: r["bytes"] for r in hlo.top_ops(hlo.parse(ASYNC_OFFLOADS), 50)["ops"]}
    assert rows["slice-start.1"] == 4194304
    gathered = 3072 * 512 * 2
    assert rows["gather_offload_async_start.update"] == 2 * gathered + 3072 * 4
    assert rows["custom-call.1"] == 2 * gathered + 3072 * 4
    assert rows["gather_offload_async_start"] == 16384 * 4


def test_hlo_text_from_xla_dump_when_as_text_fails():
    """A compiled module whose text `as_text()` cannot rebuild (libtpu's verify programs: "async-update
    instruction should have 1 operands but sees 4") is read from XLA's own dump instead: compiled again with
    `xla_dump_to`, the same ops and bytes as the printed text; without the program, an empty analysis with
    the error."""
    prog = PR.Program("tiny", jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0)),
                      (jax.ShapeDtypeStruct((16, 32), jnp.float32),), {}, 1)
    printed = hlo.top_ops(hlo.parse(prog.lower().compile().as_text()))
    dumped = hlo.top_ops(hlo.parse(AC.dumped_text(prog, None)))
    assert dumped["total_bytes"] == printed["total_bytes"] > 16 * 32 * 4
    assert dumped["instructions"] == printed["instructions"]

    class Unprintable:
        def as_text(self):
            raise RuntimeError("RET_CHECK failure async-update instruction should have 1 operands but sees 4")

    h = AC._analyse(Unprintable(), 5, None, prog, None)
    assert h["text_source"] == "xla_dump" and h["top_ops"]["total_bytes"] == printed["total_bytes"]
    empty = AC._analyse(Unprintable(), 5, None)
    assert empty["chars"] == 0 and "async-update" in empty["error"] and empty["top_ops"]["total_bytes"] == 0


def test_hlo_loops_scaled_by_trip_count():
    """The while loop runs 10 times (counter from constant 0, `< 10`): with scale_loops its body's bytes count
    10×; trip counts also come from XLA's known_trip_count or a reversed compare."""
    m = hlo.parse(SAMPLE)
    counts, loops = hlo.executions(m)
    assert counts["body"] == 10 and counts["cond"] == 11 and counts["fused_slice"] == 1
    assert loops == [{"body": "body", "trips": 10, "op_name": ""}]
    once = {r["name"]: r for r in hlo.top_ops(m, 50)["ops"]}
    scaled = {r["name"]: r for r in hlo.top_ops(m, 50, scale_loops=True)["ops"]}
    assert scaled["negate.1"]["bytes"] == 10 * once["negate.1"]["bytes"] and scaled["negate.1"]["runs"] == 10
    assert scaled["fusion"]["bytes"] == once["fusion"]["bytes"]
    flipped = SAMPLE.replace("compare(%gte.2, %constant.3), direction=LT", "compare(%constant.3, %gte.2), direction=GT")
    assert hlo.executions(hlo.parse(flipped))[0]["body"] == 10
    known = SAMPLE.replace("condition=%cond, body=%body", 'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}')
    assert hlo.executions(hlo.parse(known))[0]["body"] == 7
    unknown = SAMPLE.replace("tuple(%zero, %x)", "tuple(%i, %x)")
    assert hlo.executions(hlo.parse(unknown))[1][0]["trips"] is None       # counted once, and said so


def test_hlo_launches_scaled_by_trip_count():
    """Launched ops (fusions, custom calls, other unfused top-level ops; not bookkeeping, control flow, async
    `-done` halves or collectives): SAMPLE's entry launches 2 fusions + a copy-start, its while body a negate
    (10 trips), its condition a compare (11 runs). A CPU-compiled lax.scan of n steps: scaled − once =
    (n − 1) × the body's ops + n × the condition's."""
    m = hlo.parse(SAMPLE)
    assert hlo.launches(m) == {"count": 5, "by_kind": {"fusion": 2, "custom-call": 0, "other": 3}}
    assert hlo.launches(m, scale_loops=True) == {"count": 3 + 10 + 11,
                                                 "by_kind": {"fusion": 2, "custom-call": 0, "other": 22}}
    assert hlo.analyse(SAMPLE, scale_loops=True)["launches"]["count"] == 24

    def scan_text(n):
        def f(x, w):
            return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi) * 2.0 + 1.0, None), x, w)[0]
        return jax.jit(f).lower(jnp.zeros((4, 8)), jnp.zeros((n, 8, 8))).compile().as_text()

    for n in (3, 6):
        text = scan_text(n)
        mod = hlo.parse(text)
        (loop,) = hlo.analyse(text, scale_loops=True)["loops"]
        assert loop["trips"] == n
        ops = lambda name: sum(hlo._launched(i) is not None for i in mod.computations[name].instructions)
        cond = next(i for c in mod.computations.values() for i in c.instructions
                    if i.opcode == "while").attr("condition").lstrip("%")
        assert ops(loop["body"]) > 0
        assert hlo.launches(mod, True)["count"] - hlo.launches(mod)["count"] == \
            (n - 1) * ops(loop["body"]) + n * ops(cond)


def test_latency_roofline_arithmetic():
    """latency roofline = max(HBM bytes / bandwidth, flops / peak) + collectives × µs each + ops × µs each, at
    the chip's latencies (replaced by `chips.with_latencies`, negatives refused); rows without an op count
    (no HLO text, older reports) get none; the report table prints it next to the roofline."""
    got = AC.latency_roofline(2e-3, 10, 100, 5.0, 1.0)
    assert got["latency_roofline_s"] == pytest.approx(2e-3 + 50e-6 + 100e-6)
    assert got["collective_latency_s"] == pytest.approx(50e-6) and got["op_overhead_s"] == pytest.approx(100e-6)
    chip = chips.with_latencies(chips.CHIPS["v5p"], 2.0, 0.5)
    assert (chip.collective_latency_us, chip.op_overhead_us, chip.hbm_gbps) == (2.0, 0.5, 2765.0)
    assert chips.with_latencies(chip, None, None) == chip
    assert chips.CHIPS["v6e"].collective_latency_us == 5.0 and chips.CHIPS["v6e"].op_overhead_us == 1.0
    for bad in ((-1.0, None), (None, -0.1), (float("nan"), None)):
        with pytest.raises(ValueError, match=">= 0"):
            chips.with_latencies(chip, *bad)
    hbm = 2765e9 * 1e-3                                              # 1 ms of HBM bytes on v5p
    row = {"cost": {"flops": 459e12 * 0.5e-3},                       # 0.5 ms of flops: memory-bound
           "hlo": {"top_ops": {"total_bytes": hbm}, "collectives": {"count": 4},
                   "launches": {"count": 300, "by_kind": {"fusion": 290, "custom-call": 10, "other": 0}}}}
    e = AC.estimates(row, chip, 8)
    assert e["roofline_s"] == pytest.approx(1e-3)
    assert e["latency_roofline_s"] == pytest.approx(1e-3 + 4 * 2e-6 + 300 * 0.5e-6)
    assert e["latency_counts"]["ops"] == 300 and e["op_overhead_us"] == 0.5
    old = {"cost": row["cost"], "hlo": {k: v for k, v in row["hlo"].items() if k != "launches"}}
    assert "latency_roofline_s" not in AC.estimates(old, chip, 8)
    run = {"chips": 8, "chip": dataclasses.asdict(chip),
           "programs": [{"program": "decode", "compiled": True, "estimate": e, **row}]}
    cells = dict(zip(R.PROGRAM_HEAD, R.program_rows(run)[0]))
    assert cells["ms roofline"] == R._ms(1e-3) and cells["ms latency roofline"] == R._ms(1.158e-3)
    assert cells["collectives / ops"] == "4 / 300"
    assert "2 µs per collective, 0.5 µs per" in R._latency_line(run)


def test_latency_options_parse_and_reject_negatives(capsys):
    """--collective-latency-us / --op-overhead-us: numbers ≥ 0 into the request (None: the chips' defaults) and
    the report's meta; a negative or non-number is refused by argparse naming the flag."""
    p = cli.build_parser()
    a = p.parse_args(["--topology", "cpu", "--small", "--collective-latency-us", "2.5", "--op-overhead-us", "0"])
    req = cli.parse_request(a, [])
    assert (req.collective_latency_us, req.op_overhead_us) == (2.5, 0.0)
    meta = runner.latency_meta(req)
    assert (meta["collective_latency_us"], meta["op_overhead_us"]) == (2.5, 0.0)
    assert meta["source"]["op_overhead_us"] == "command line"
    default = runner.latency_meta(cli.parse_request(p.parse_args(["--topology", "cpu", "--small"]), []))
    assert (default["collective_latency_us"], default["op_overhead_us"]) == (5.0, 1.0)
    assert "assumed" in default["source"]["collective_latency_us"]
    for argv, flag in ((["--op-overhead-us=-1"], "--op-overhead-us"),
                       (["--collective-latency-us", "-3"], "--collective-latency-us"),
                       (["--collective-latency-us", "fast"], "--collective-latency-us")):
        with pytest.raises(SystemExit):
            cli.main(["--topology", "cpu", "--small", "--plan", *argv])
        err = capsys.readouterr().err
        assert flag in err and ">= 0" in err, err


def test_hlo_collectives():
    col = hlo.collectives(hlo.parse(SAMPLE))
    by = col["by_opcode"]
    assert set(by) == {"all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all"}
    assert by["all-reduce"] == {"count": 1, "operand_bytes": 16384.0, "result_bytes": 16384.0}
    assert by["all-gather"]["result_bytes"] == 65536.0
    assert by["reduce-scatter"]["result_bytes"] == 4096.0
    sizes = {o["opcode"]: o["group_size"] for o in col["ops"]}
    assert sizes == {"all-reduce": 4, "all-gather": 4, "reduce-scatter": 2, "collective-permute": None,
                     "all-to-all": 4}
    assert by["all-to-all"]["operand_bytes"] == 8 * 512 * 2
    assert col["total_operand_bytes"] == 4 * 16384.0 + 8 * 512 * 2


def test_hlo_shapes_and_errors():
    a = hlo.arrays("(bf16[2,3]{1,0:T(8,128)(2,1)S(1)}, f8e4m3fn[4]{0}, s4[8], pred[])")
    assert [(x.dtype, x.dims, x.memory_space) for x in a] == [("bf16", (2, 3), 1), ("f8e4m3fn", (4,), 0),
                                                              ("s4", (8,), 0), ("pred", (), 0)]
    assert [x.nbytes for x in a] == [12, 4, 4, 1]
    assert hlo.hbm_bytes("(bf16[2,3]{1,0:S(1)}, f32[5]{0})") == 20
    with pytest.raises(ValueError, match="no computations"):
        hlo.parse("not hlo")


# ---- names, messages, options ---------------------------------------------------------------------

def test_topology_names():
    t = chips.parse("v5p:2x2x2")
    assert (t.chip.name, t.grid, t.chips, t.is_tpu) == ("v5p", (2, 2, 2), 8, True)
    assert chips.parse("v5litepod:4x4").chips == 16 and chips.parse("v6e:2x4").chip.hbm_gbps == 1638.0
    assert chips.parse("cpu").chips == 1 and not chips.parse("cpu:4").is_tpu
    for bad, msg in (("v9z:2x2", "unknown TPU generation"), ("v5p:2x2", "3-D chip grid"),
                     ("v5e", "needs a chip grid"), ("v5p/2x2x2", "must look like")):
        with pytest.raises(chips.TopologyError, match=msg):
            chips.parse(bad)
    assert chips.hbm_from_error("RESOURCE_EXHAUSTED: ... exceeds available HBM (95.74G).") == 95.74 * chips.GIB
    assert chips.hbm_from_error("Used 120.5G of 15.75G hbm. Exceeded") == 15.75 * chips.GIB
    msg = "Ran out of memory on HBM, the total memory required for HLO temporaries (128.52G) exceeds available HBM"
    assert chips.required_from_error(msg) == 128.52 * chips.GIB
    assert chips.required_from_error("Used 120.5G of 15.75G hbm.") == 120.5 * chips.GIB


def test_libtpu_missing_message(monkeypatch, capsys):
    monkeypatch.setattr(libtpu, "available", lambda: False)
    assert cli.main(["--topology", "v5p:2x2x1", "--small", "--programs", "decode"]) == 2
    err = capsys.readouterr().err
    assert "libtpu" in err and "pip install libtpu" in err and "jax[tpu]" in err
    with pytest.raises(chips.LibtpuMissing, match="pip install libtpu"):
        chips.devices(chips.parse("v6e:2x4"))


def test_bad_input_is_refused_before_work(capsys):
    cases = [(["--topology", "v5x:2x2"], "unknown TPU generation"),
             (["--topology", "v5p:2x2x2", "--mesh", "1x4x1", "--plan"], "has 4 devices"),
             (["--pairs", "99", "--plan"], "--pairs must be in"),
             (["--kernels", "pallas", "--plan"], "do not compile for TPU")]
    for argv, msg in cases:
        assert cli.main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    for argv in (["--programs", "decode,nope"], ["--weights", "bf16,fp4"], ["--kernels", "triton"]):
        with pytest.raises(SystemExit):
            cli.main(argv)


def test_kernels_choose_static_backends():
    """--kernels pallas_tpu: the Mosaic MoE and indexer kernels (routing has none), compiled for TPU, interpret
    mode when compiled for the CPU backend; layers unrolled unless --no-unroll."""
    tpu = runner.model_config("flash", pairs=0, small=True, backends="pallas_tpu", platform="tpu").backends
    assert (tpu.moe, tpu.routing, tpu.indexer, tpu.interpret, tpu.unroll_layers) == \
        ("pallas_tpu", "reference", "pallas_tpu", False, True)
    assert runner.model_config("flash", small=True, backends="auto", platform="tpu").backends == tpu
    cpu = runner.model_config("flash", small=True, backends="pallas_tpu", platform="cpu", unroll=False).backends
    assert cpu.interpret and not cpu.unroll_layers
    assert runner.model_config("flash", small=True).backends.moe == "reference"


def test_plan_needs_no_libtpu(monkeypatch, capsys):
    """--plan: per-device arguments from the shardings alone (flash() bf16 on 8 v5p chips: ≈78 GiB)."""
    monkeypatch.setattr(libtpu, "available", lambda: False)
    assert cli.main(["--topology", "v5p:2x2x2,v5e:4x4", "--weights", "bf16", "--programs", "decode", "--plan"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("decode")]
    assert len(lines) == 2 and "arguments fit" in lines[0] and "DOES NOT FIT" in lines[1]
    gib = float(lines[0].split()[2])
    assert 75 < gib < 82


# ---- programs from abstract shapes (no compile) ---------------------------------------------------

def test_programs_carry_the_forecast_bounds_per_k():
    """verify and the rounds carry their bound at every k of the payoff forecast (DSpark: k ≤ its block);
    at the compiled k it is the program's own bound (no compile: abstract mesh)."""
    from jax.sharding import AbstractMesh
    from dsv4_jax.analysis.aot import bounds as BD, forecast as F
    cfg = runner.model_config("flash", small=True, platform="cpu")
    mesh, sh = AbstractMesh((1, 1, 1), parallel.MESH_AXES), I.Shapes(1, 4096, 3, 16)
    verify = PR.build("verify", cfg, mesh, "release", sh).bound
    assert [int(k) for k in verify["by_k"]] == list(F.K_RANGE)
    assert verify["by_k"]["3"] == verify["total"]
    assert verify["by_k"]["6"] == BD.target_bound(cfg, "release", 1, 4096, 7)["total"] > verify["total"]
    mtp_prog = PR.build("spec-mtp", cfg, mesh, "release", sh)
    mtp = mtp_prog.bound
    assert [int(k) for k in mtp["by_k"]] == list(F.K_RANGE) and mtp["by_k"]["3"] == mtp["total"]
    assert mtp["by_k"]["5"] == BD.mtp_round_bound(cfg, "release", 1, 4096, 5)["total"]
    # the drafter MoE passes the Mosaic declared bytes add (`runner.ep_kernel_row`): k − 1 chain steps, one observe
    assert mtp_prog.drafter_moe == (("mtp chain", 1, 2), ("mtp observe", 4, 1))
    dspark_prog = PR.build("spec-dspark", cfg, mesh, "release", sh)
    assert dspark_prog.drafter_moe == (("dspark block", 5, len(dspark_prog.args[0]["dspark"]["stages"])),)
    dspark = dspark_prog.bound
    assert [int(k) for k in dspark["by_k"]] == [1, 2, 3, 4, 5] and dspark["by_k"]["3"] == dspark["total"]
    assert "by_k" not in PR.build("decode", cfg, mesh, "release", sh).bound


SHAPES = I.Shapes(batch=2, context=64, draft_n_max=2, prefill_chunk=8)


def scan_config(reps: int, unroll: bool = True, hidden: int = 512) -> C.ModelConfig:
    """One hash-routed sliding layer, then `reps` score-routed sliding layers (a layer scan when reps ≥ 2).
    Wider than tiny() so the layer's work dominates what XLA shares across layers (positions, masks)."""
    cfg = C.tiny().replace(name=f"aot-test-{reps}-{hidden}", num_layers=1 + reps, layer_types=(C.SLIDING,) * (1 + reps),
                           compress_ratios=(0,) * (1 + reps), mlp_layer_types=(C.HASH_MOE,) + (C.MOE,) * reps,
                           hidden_size=hidden, q_lora_rank=256, head_dim=64, rope_head_dim=16, o_lora_rank=128,
                           moe_intermediate_size=512, index_head_dim=32)
    return cfg.with_backends(cfg.backends.replace(unroll_layers=unroll))


def test_programs_from_abstract_shapes():
    """Every program builds from ShapeDtypeStructs on a 2-device abstract mesh: fp8 experts are QArrays split
    like their dense twins (codes 1 byte, f32 block scales); release weights are FP4 experts and FP8
    projections whose stored bytes are traffic's; bounds grow decode < verify < rounds, DSpark's k is capped
    at its block size."""
    from jax.sharding import AbstractMesh
    cfg = runner.model_config("flash", pairs=1, small=True, platform="cpu")
    mesh = AbstractMesh((1, 2, 1), parallel.MESH_AXES)
    sh = I.Shapes(batch=4, context=512, draft_n_max=6, prefill_chunk=16)
    progs = {(n, w): PR.build(n, cfg, mesh, w, sh) for n in PR.PROGRAMS for w in I.WEIGHTS}
    layer = lambda w: progs["decode", w].args[0]["segments"][-1][0]
    ex_bf16, ex_fp8 = layer("bf16")["ffn"]["experts"], layer("fp8")["ffn"]["experts"]
    w1 = ex_fp8["w1"]
    assert isinstance(w1, quant.QArray) and w1.shape == ex_bf16["w1"].shape and w1.dtype == "bfloat16"
    assert str(w1.codes.dtype) == "float8_e4m3fn" and str(w1.scale.dtype) == "float32"
    assert w1.codes.sharding.spec == ex_bf16["w1"].sharding.spec and w1.codes.sharding.shard_shape(w1.shape)[1] == 8
    assert w1.scale.shape[-2:] == (1, 1)                              # one block: [32, 64] < 128 x 128
    dense = I.per_device_bytes(ex_bf16)
    assert I.per_device_bytes(ex_fp8) == dense / 2 + 3 * 8 * 4      # + 8 experts' f32 scale per device
    assert not isinstance(layer("fp8")["attn"]["wq_a"], quant.QArray)
    rel = layer("release")
    assert rel["ffn"]["experts"]["w2"].fmt == quant.FP4 and rel["attn"]["wq_a"].fmt == quant.FP8
    assert rel["ffn"]["shared_experts"]["w1"].fmt == quant.FP8 and not isinstance(rel["ffn"]["gate"]["weight"],
                                                                                 quant.QArray)
    assert str(rel["ffn"]["experts"]["w2"].codes.dtype) == "uint8"
    assert I.total_bytes(progs["decode", "release"].args[0]) == \
        pytest.approx(traffic.stored_bytes(P.param_specs(cfg), "release"), rel=1e-12)
    assert isinstance(progs["spec-dspark", "release"].args[0]["dspark"]["stages"][0]["attn"]["wkv"], quant.QArray)
    b = {n: progs[n, "bf16"].bound["total"] for n in PR.PROGRAMS}
    assert b["decode"] < b["verify"] < b["spec-mtp"] and b["verify"] < b["spec-dspark"]
    assert progs["spec-dspark", "bf16"].tokens_per_sequence == 6 and "block size 5" in progs["spec-dspark", "bf16"].notes
    assert progs["prefill", "release"].bound["total"] < progs["prefill", "fp8"].bound["total"] < b["prefill"]
    args = progs["spec-mtp", "bf16"].args
    assert args[2].target.pos.shape == (4,) and args[2].drafter.cache.window.kv.sharding.spec[0] == "expert"


# ---- compiles on the CPU backend ------------------------------------------------------------------

def cpu_compile(cfg: C.ModelConfig, program: str = "decode", weights: str = "bf16", hbm: float = 16 * chips.GIB,
                unrolled: bool = True):
    topo = chips.parse("cpu")
    mesh = parallel.make_mesh((1, 1, 1), chips.devices(topo))
    return AC.compile_program(PR.build(program, cfg, mesh, weights, SHAPES), AC.Slice(topo.chip, 1, hbm),
                              unrolled=unrolled)


def test_unrolled_scan_counts_every_layer():
    """XLA counts a while body once: with the layer scan rolled (the program as run), a 2-rep scan's flops are
    base + body; unrolled (`Backends.unroll_layers`, what the report counts) they are base + 2·body. (Bytes are
    not compared: a rolled loop adds its own carry copies and slicing.) The row holds both compiles."""
    topo = chips.parse("cpu")
    mesh = parallel.make_mesh((1, 1, 1), chips.devices(topo))
    base = cpu_compile(scan_config(0))["cost"]["flops"]
    row = AC.compile_program(PR.build("decode", scan_config(2), mesh, "bf16", SHAPES),
                             AC.Slice(topo.chip, 1, 16 * chips.GIB),
                             as_run=PR.build("decode", scan_config(2, unroll=False), mesh, "bf16", SHAPES))
    rolled, unrolled = row["cost_as_run"]["flops"], row["cost"]["flops"]
    body = rolled - base
    assert body > 0.5 * base
    assert unrolled - base == pytest.approx(2 * body, rel=0.01)
    assert row["memory"] == row["memory_as_run"] and row["fit_from"].startswith("as run") and row["fits"]
    assert row["memory_unrolled"]["peak"] > 0 and row["as_run_compile_s"] > 0


def test_extrapolated_costs_predict_the_unrolled_compile(monkeypatch):
    """The default counting ("extrapolated"): the program as run (a 4-rep layer scan) gives the fit; the 2- and
    3-rep unrolled compiles, extrapolated linearly (cost(4) = cost(2) + 2·(cost(3) − cost(2))), predict the
    4-rep unrolled compile's flops and transcendentals to 1e-6 and its bytes accessed to 1e-3 (measured:
    1.4e-7 and 1.0e-4). f32 weights: with bf16 the CPU backend converts each whole stacked weight to f32 for
    every unrolled rep (a CPU-only cost growing as reps², measured −5 % flops / −7 % bytes from 2 and 3 reps
    to 4); the TPU numbers at Flash shapes are in experiments/results/aot_extrapolation_2026-12-01.md. From 1
    and 2 reps the bytes miss by 4 % (a single rep is not a stacked segment: no slicing of a stack), hence
    the default base of 2 reps."""
    monkeypatch.setattr(I, "COMPUTE_DTYPE", jnp.float32)
    topo = chips.parse("cpu")
    mesh = parallel.make_mesh((1, 1, 1), chips.devices(topo))
    cfg = scan_config(4, hidden=256)
    how = runner.counting(cfg, "extrapolate")
    a, n, at_a, at_b = how.points
    assert (how.method, a, n, at_a.num_layers, at_b.num_layers) == ("extrapolated", 2, 4, 3, 4)
    assert not how.program.backends.unroll_layers and at_a.backends.unroll_layers
    build = lambda c: PR.build("decode", c, mesh, "bf16", SHAPES)
    row = AC.compile_program(build(how.program), AC.Slice(topo.chip, 1, 16 * chips.GIB),
                             counting=AC.Counting(a, n, build(at_a), build(at_b), (3, 4)))
    truth = cpu_compile(cfg)["cost"]                                    # the 4-rep program unrolled
    assert row["cost_method"] == "extrapolated" and row["cost_counts_every_layer"] and row["fits"]
    assert row["cost"]["flops"] == pytest.approx(truth["flops"], rel=1e-6)
    assert row["cost"]["transcendentals"] == pytest.approx(truth["transcendentals"], rel=1e-6)
    assert row["cost"]["bytes_accessed"] == pytest.approx(truth["bytes_accessed"], rel=1e-3)
    assert row["cost_as_run"]["flops"] < 0.75 * truth["flops"]          # the scan counts its body once
    assert [p["reps"] for p in row["cost_points"]] == [2, 3] and row["fit_from"].startswith("as run")
    assert R.cost_method(row) == "extrapolated (3, 4 L)"
    assert runner.counting(scan_config(3), "extrapolate").method == "unrolled"   # 3 reps: as small as 2 + 3
    assert runner.counting(cfg, "scan").as_run is None and runner.counting(cfg, "unroll").as_run is not None
    flash = runner.model_config("flash")
    assert [X.with_reps(flash, r).num_layers for r in (2, 3, 20)] == [7, 9, 43]
    assert X.points(flash) == (2, 3, 20) and X.linear({"f": 1.0, "s": "x"}, {"f": 3.0}, 2, 20) == {"f": 37.0}
    with pytest.raises(ValueError, match="cannot keep 21"):
        X.with_reps(flash, 21)


def test_fit_from_saved_report_rows():
    """--fit-from: a saved row of the same program as run (same model, shapes, topology, weights, mesh; prefill:
    the same chunk) is reused: a "scan" row's cost becomes cost_as_run, an "unrolled" row's memory_as_run the
    memory; rows that differ in any of those, or unrolled rows without an as-run compile, are not."""
    cfg = runner.model_config("flash")
    sh = I.Shapes(8, 32768, 3, 256)
    scan = {"program": "decode", "compiled": True, "cost_counts_every_layer": False, "cost": {"flops": 1.0},
            "memory": {"peak": 5.0}, "hlo": {}, "tokens_per_sequence": 1}
    unrolled = {"program": "verify", "compiled": True, "cost_counts_every_layer": True, "cost": {"flops": 9.0},
                "memory": {"peak": 7.0}, "memory_as_run": {"peak": 6.0}, "hlo": {}, "tokens_per_sequence": 4}
    prefill = dict(scan, program="prefill", tokens_per_sequence=128)
    bare = dict(unrolled, program="spec-mtp")
    del bare["memory_as_run"]
    rep = {"meta": {"date": "d", "command": "c"}, "model": {"name": "flash", "layers": 43},
           "shapes": dataclasses.asdict(sh),
           "runs": [{"topology": "v5p:2x2x1", "weights": "fp8", "mesh_text": "1×4×1",
                     "programs": [scan, unrolled, prefill, bare]}]}
    find = lambda *a, chunk=256, config=cfg, shapes=sh: runner.reusable_row([("r.json", rep)], config, shapes, a[:3],
                                                                            a[3], chunk)
    d = find("v5p:2x2x1", "fp8", "1×4×1", "decode")
    assert d["cost_as_run"] == {"flops": 1.0} and d["memory"] == {"peak": 5.0} and d["fit_source"] == "r.json (d: c)"
    assert find("v5p:2x2x1", "fp8", "1×4×1", "verify")["memory"] == {"peak": 6.0}
    assert find("v5p:2x2x1", "fp8", "1×4×1", "prefill") is None
    assert find("v5p:2x2x1", "fp8", "1×4×1", "prefill", chunk=128)["memory"] == {"peak": 5.0}
    assert find("v5p:2x2x1", "fp8", "1×4×1", "spec-mtp") is None
    assert find("v5p:2x2x1", "bf16", "1×4×1", "decode") is None and find("v5p:2x2x2", "fp8", "1×4×1", "decode") is None
    assert find("v5p:2x2x1", "fp8", "1×4×1", "decode", shapes=I.Shapes(8, 4096, 3, 256)) is None
    assert find("v5p:2x2x1", "fp8", "1×4×1", "decode", config=runner.model_config("flash", pairs=2)) is None


def test_report_on_cpu_backend(tmp_path):
    """decode and the MTP round compile (fp8 experts; decode also with release weights) and fit; each row has memory / cost / HLO / bound /
    estimates; the report files are written and the JSON re-renders (merged) through --render."""
    cfg = C.tiny().replace(name="aot-test-1", num_layers=1, layer_types=(C.SLIDING,), compress_ratios=(0,),
                           mlp_layer_types=(C.MOE,))
    rep = runner.run(runner.AotRequest(("cpu",), ("fp8",), SHAPES, cfg, programs=("decode", "spec-mtp"), hbm_gib=1.0,
                                       fit_as_run=False), log=None)
    (run,) = rep["runs"]
    assert [r["program"] for r in run["programs"]] == ["decode", "spec-mtp"]
    for r in run["programs"]:
        assert r["compiled"] and r["fits"] is True, r.get("reason")
        m = r["memory"]
        assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] > 0
        assert m["argument"] == pytest.approx(r["argument_bytes_per_device"], rel=0.01)
        assert r["cost"]["flops"] > 0 and r["cost"]["bytes_accessed"] > 0
        assert r["bound"]["total"] > 0 and r["estimate"]["roofline_s"] > 0
        assert r["hlo"]["top_ops"]["ops"] and r["hlo"]["top_ops"]["total_bytes"] > 0
    mtp = run["programs"][1]
    assert mtp["bound"]["drafter"] > 0 and mtp["bound"]["total"] > run["programs"][0]["bound"]["total"]
    out = str(tmp_path / "r.json")
    paths = R.write(rep, out)
    assert [os.path.basename(p) for p in paths] == ["r.json", "r.md", "r.png"]
    md = open(tmp_path / "r.md").read()
    assert "Will it fit, and how fast could it be" in md and "| spec-mtp |" in md
    other = json.loads(json.dumps(rep))
    other["runs"][0]["programs"] = [dict(run["programs"][0], program="verify")]
    other["runs"].append(dict(run, topology="cpu:2"))
    json.dump(other, open(tmp_path / "o.json", "w"))
    assert cli.main(["--render", out, str(tmp_path / "o.json"), "--out", str(tmp_path / "m.json"), "--no-plot"]) == 0
    merged = json.load(open(tmp_path / "m.json"))            # the same run gains verify; cpu:2 is appended
    assert [[p["program"] for p in r["programs"]] for r in merged["runs"]] == [["decode", "spec-mtp", "verify"],
                                                                              ["decode", "spec-mtp"]]
    assert len(merged["meta"]["sources"]) == 2 and "merged from" in open(tmp_path / "m.md").read()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")]
    tight = cpu_compile(cfg, "decode", "fp8", hbm=1000.0)
    assert tight["fits"] is False and not tight["compiled"] and "arguments alone" in tight["reason"]
    release = cpu_compile(cfg, "decode", "release", unrolled=False)  # FP4 experts, FP8 projections as QArrays
    assert release["compiled"] and release["fits"], release.get("reason")
    assert release["fit_from"].startswith("as run") and not release["cost_counts_every_layer"]
    assert "memory_unrolled" not in release and "hlo_unrolled" not in release
    assert release["memory"]["argument"] == pytest.approx(release["argument_bytes_per_device"], rel=0.01)
    assert release["argument_bytes_per_device"] < run["programs"][0]["argument_bytes_per_device"]


@pytest.mark.slow
def test_libtpu_compile_counts_every_layer():
    """The same path through libtpu for v5p:2x2x1 (4 chips): HBM from the compiler, collectives in the
    text, and the unrolled 2-rep scan reporting twice the rolled body."""
    if not libtpu.available():
        pytest.fail("this test needs libtpu (pip install libtpu)")
    topo = chips.parse("v5p:2x2x1")
    devs = chips.devices(topo)
    mesh = parallel.make_mesh((1, 4, 1), devs)
    hbm, source = chips.hbm_bytes(topo, devs)
    assert source.startswith("TPU compiler") and 90 * chips.GIB < hbm < 100 * chips.GIB
    opts = chips.TPU_COMPILE_OPTIONS
    base = AC.compile_program(PR.build("decode", scan_config(0), mesh, "bf16", SHAPES), AC.Slice(topo.chip, 4, hbm),
                              opts=AC.CompileOptions(opts))["cost"]["flops"]
    row = AC.compile_program(PR.build("decode", scan_config(2), mesh, "bf16", SHAPES), AC.Slice(topo.chip, 4, hbm),
                             as_run=PR.build("decode", scan_config(2, unroll=False), mesh, "bf16", SHAPES),
                             opts=AC.CompileOptions(opts))
    assert row["compiled"] and row["fits"], row.get("reason")
    assert row["hlo"]["collectives"]["count"] > 0
    body = row["cost_as_run"]["flops"] - base
    assert row["cost"]["flops"] - base == pytest.approx(2 * body, rel=0.01)


def test_prefill_chunk_halves_until_it_fits():
    """An out-of-memory prefill chunk is halved until the compiler accepts it; the attempts are listed."""
    seen, floor = [], [8]

    def fake(sh, last_try):
        assert last_try == (sh.prefill_chunk // 2 < floor[0])
        seen.append(sh.prefill_chunk)
        if sh.prefill_chunk > 64:
            return {"program": "prefill", "fits": False, "compiled": False, "required_bytes": sh.prefill_chunk * chips.GIB,
                    "reason": "compiler: out of memory"}
        return {"program": "prefill", "fits": True, "compiled": True, "tokens_per_sequence": sh.prefill_chunk}

    row = runner.compile_prefill(fake, I.Shapes(8, 1024, 3, 256), 8)
    assert seen == [256, 128, 64] and row["fits"] and row["tokens_per_sequence"] == 64
    assert [a["prefill_chunk"] for a in row["attempts"]] == [256, 128, 64] and "128: needs 128.0 GiB" in row["notes"]
    seen.clear()
    floor[0] = 200
    row = runner.compile_prefill(fake, I.Shapes(8, 1024, 3, 256), 200)        # floor: one attempt only
    assert seen == [256] and row["fits"] is False and "attempts" not in row


def test_kernels_section_from_the_kernels_helper():
    """The kernels section calls the kernels' AOT helper (Shapes / Case / compile_case; analysis.kernels_aot):
    cases for the report's shapes in the report's weight format, records flattened into rows."""
    import types
    from dsv4_jax.analysis.aot import kernel_hook as K
    calls = []
    fake = types.SimpleNamespace(
        __name__="fake_aot", Shapes=lambda **kw: kw,
        Case=lambda kernel, fmt="dense", **kw: types.SimpleNamespace(kernel=kernel, fmt=fmt, name=kernel, **kw),
        compile_case=lambda case, topology, s: calls.append((case, topology, s)) or {
            "kernel": case.kernel, "case": case.name, "compile_s": 2.0,
            "compiled": {"xla_flops": 1.0, "temp_bytes": 5, "xla_bytes_accessed": 10.0},
            "blockspec_bytes": {"random": {"total": 7, "ideal": 6}}, "reference": {"xla_bytes_accessed": 99.0}})
    out = K.kernel_reports("v5p:2x2x1", C.flash(), I.Shapes(8, 1024, 3, 64), "fp8", aot=fake)
    assert out["available"] and out["source"] == "fake_aot" and len(out["rows"]) == len(calls) == 6
    tokens = [c.tokens for c, _, _ in calls if c.kernel.startswith("moe")]
    assert tokens == [8, 32, 512] and {c.fmt for c, _, _ in calls if c.kernel.startswith("moe")} == {"fp8"}
    assert calls[0][2]["n_experts"] == 256 and calls[3][0].rows == 256
    assert out["rows"][0] == {"kernel": "moe_decode", "case": "moe_decode", "compile_s": 2.0, "flops": 1.0,
                              "temp_bytes": 5, "xla_bytes": 10.0, "blockspec_bytes": 7, "ideal_bytes": 6,
                              "reference_xla_bytes": 99.0}
    assert "| moe_decode |" in "\n".join(R.kernel_section(out))
    release = K.kernel_reports("v5p:2x2x1", C.flash(), I.Shapes(8, 1024, 3, 64), "release", aot=fake)
    assert {r["case"] for r in release["rows"]} >= {"moe_decode"} and calls[-6][0].fmt == "fp4_e2m1_b32"
    from dsv4_jax.kernels import tpu_common
    assert set(K.KERNEL_FORMAT.values()) <= set(tpu_common.FORMATS)


def test_sharding_setup_picks_the_preset_and_ep_backends():
    """`--sharding`: auto picks latency for few sequences per chip, throughput for many; the config gets the
    preset's expert-parallel MoE on the preset's mesh, and --kernels pallas_tpu becomes the EP local matmul."""
    assert EP.resolve_name("auto", 8, 8) == "latency" and EP.resolve_name("auto", 16, 8) == "throughput"
    with pytest.raises(ValueError, match="unknown sharding"):
        EP.resolve_name("gspmd", 8, 8)
    devs = jax.devices()[:1]
    cfg = runner.model_config("flash", pairs=0, small=True, platform="cpu")
    name, c, mesh, rules = EP.setup("latency", cfg, devs, 8)
    assert name == "latency" and c.backends.moe == "ep" and c.backends.ep.mesh is mesh
    assert rules["experts"] == () and c.backends.unroll_layers == cfg.backends.unroll_layers
    kcfg = runner.model_config("flash", pairs=0, small=True, platform="cpu", backends="pallas_tpu")
    assert EP.setup("throughput", kcfg, devs, 8)[1].backends.ep.local == "pallas_tpu"


def test_routed_expert_codes_placed_as_a_run_holds_them():
    """The programs' routed experts go through the loader's rule (`expert_words.for_run`): on TPU under EP with
    the XLA local matmul only the routed experts' QArray codes and scales get the swapped-minor-dims layout
    (sharding kept), the FP4 ones in the uint32 word layout (the shapes `quant.to_words` gives); shared experts
    and dense leaves are untouched; on CPU the words keep the default layout; the Pallas local matmul keeps the
    uint8 codes as placed."""
    cfg = runner.model_config("flash", pairs=0, small=True, platform="cpu")
    devs = jax.devices()[:1]
    _, ep_cfg, mesh, _ = EP.setup("latency", cfg, devs, 8)
    on_tpu = ep_cfg.backends.replace(ep=dataclasses.replace(ep_cfg.backends.ep, local="dense"))   # TPU's auto
    params = I.target_params(cfg, mesh, "release")
    moved = expert_words.for_run(params, on_tpu, "tpu")
    flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
    n_moved = 0
    words = lambda q: jax.eval_shape(quant.to_words, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), q))
    routed = lambda q: isinstance(q, quant.QArray) and q.fmt == quant.FP4
    want = jax.tree.map(lambda q: words(q) if routed(q) and quant.words_fit(q, shard_group(q)) else q, params,
                        is_leaf=lambda q: isinstance(q, quant.QArray))
    assert jax.tree.structure(moved) == jax.tree.structure(want)
    for (path, a), (_, w), (_, b) in zip(flat(params), flat(want), flat(moved)):
        key = jax.tree_util.keystr(path)
        assert (w.shape, w.dtype) == (b.shape, b.dtype), key
        if "['experts']" in key:
            nd = len(a.shape)
            assert b.format.layout.major_to_minor == (*range(nd - 2), nd - 1, nd - 2), key
            assert b.sharding == a.sharding
            n_moved += 1
        else:
            assert b is a, key
    assert n_moved > 0 and n_moved % 6 == 0           # codes + scale of w1, w2, w3 per routed layer stack
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    big = {"ffn": {"experts": {"w2": quant.abstract(quant.FP4, (4, 32, 512), jnp.bfloat16, sh, sh)}}}
    q = expert_words.for_run(big, on_tpu, "tpu")["ffn"]["experts"]["w2"]
    assert q.fmt == quant.FP4_WORDS and q.shape == (4, 32, 512)         # K not split: one group
    sd = lambda t: [(a.shape, a.dtype) for a in jax.tree.leaves(t)]
    assert sd(q) == sd(words(big["ffn"]["experts"]["w2"])) == [((4, 32, 64), jnp.uint32), ((4, 32, 4), jnp.uint32)]
    assert q.codes.sharding == sh
    for a in (q.codes, q.scale):
        nd = len(a.shape)
        assert a.format.layout.major_to_minor == (*range(nd - 2), nd - 1, nd - 2)
    on_cpu = expert_words.for_run(big, on_tpu, "cpu")["ffn"]["experts"]["w2"]
    assert on_cpu.fmt == quant.FP4_WORDS and not isinstance(on_cpu.codes.sharding, Format)
    assert getattr(on_cpu.codes, "format", None) is None or on_cpu.codes.format.layout is None
    pallas = on_tpu.replace(ep=dataclasses.replace(on_tpu.ep, local="pallas_tpu"))
    assert expert_words.for_run(big, pallas, "tpu") is big


def test_pallas_in_the_ep_program_lowers_for_the_chip_and_keeps_the_kernels_layout():
    """`--sharding --kernels pallas_tpu`: on more than one chip the indexer kernel (GSPMD-partitioned part of
    the program, which XLA cannot split for a Mosaic custom call) becomes the reference, the MoE local matmul
    stays Mosaic; the routed experts keep the row-major uint8 layout the kernel reads (no k-major words); a
    program holding Mosaic kernels on TPU is lowered under its mesh (Pallas reads the chip from it)."""
    kb = C.Backends(moe="pallas_tpu", indexer="pallas_tpu")
    assert EP.gspmd_safe(kb, 8).indexer == "reference" and EP.gspmd_safe(kb, 8).moe == "pallas_tpu"
    assert EP.gspmd_safe(kb, 1) == kb and EP.gspmd_safe(C.Backends(), 8) == C.Backends()
    devs = jax.devices()[:1]
    kcfg = runner.model_config("flash", pairs=0, small=True, platform="cpu", backends="pallas_tpu")
    _, c, mesh, _ = EP.setup("latency", kcfg, devs, 8)
    assert c.backends.ep.local == "pallas_tpu" and c.backends.indexer == "pallas_tpu"     # one chip: kept
    assert not expert_words.wants_words(c.backends)                    # the kernels read the uint8 codes
    ref = EP.setup("latency", runner.model_config("flash", pairs=0, small=True, platform="cpu"), devs, 8)[1]
    assert PR.uses_mosaic(c, mesh) is False                                   # CPU devices: interpret mode
    fake_tpu = type("M", (), {"devices": np.array([type("D", (), {"platform": "tpu"})()])})()
    assert PR.uses_mosaic(c, fake_tpu) is True and PR.uses_mosaic(ref, fake_tpu) is False
    seen = []

    def f(a):
        seen.append(jax.sharding.get_abstract_mesh().axis_names)
        return a * 2
    prog = PR.Program("p", jax.jit(f), (jax.ShapeDtypeStruct((4,), jnp.float32),), {}, 1, mesh=mesh)
    prog.lower()
    PR.Program("p", jax.jit(lambda a: f(a) + 1), prog.args, {}, 1).lower()
    assert seen == [mesh.axis_names, ()]


def test_no_hlo_dump_compile_leaves_unprintable_hlo_out(monkeypatch):
    """`--no-hlo-dump`: a program whose HLO libtpu cannot print is not compiled again for XLA's dump; its
    row keeps memory and costs, and `hlo.error` says why the HLO ops are missing."""
    prog = PR.Program("tiny", jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0)),
                      (jax.ShapeDtypeStruct((16, 32), jnp.float32),), {}, 1)
    dumps, dumped = [], AC.dumped_text
    monkeypatch.setattr(AC, "dumped_text", lambda p, o: dumps.append(p) or dumped(p, o))
    real = AC._compile

    class Unprintable:
        def __init__(self, c):
            self.c = c

        def __getattr__(self, name):
            return getattr(self.c, name)

        def as_text(self):
            raise RuntimeError("async-update instruction should have 1 operands but sees 4")

    monkeypatch.setattr(AC, "_compile", lambda p, o: (Unprintable(real(p, o)[0]), *real(p, o)[1:]))
    chip = chips.parse("v5p:2x2x1").chip
    row = AC.compile_program(prog, AC.Slice(chip, 1, 16 * chips.GIB), unrolled=False,
                             opts=AC.CompileOptions(hlo_dump_compile=False))
    assert dumps == [] and row["compiled"] and row["memory"]["peak"] > 0
    assert "async-update" in row["hlo"]["error"] and row["hlo"]["top_ops"]["total_bytes"] == 0
    AC.compile_program(prog, AC.Slice(chip, 1, 16 * chips.GIB), unrolled=False)
    assert dumps == [prog]                                            # the default: one more compile
    assert cli.build_parser().parse_args(["--no-hlo-dump"]).no_hlo_dump


def test_ep_kernel_declared_bytes_next_to_xla():
    """The Mosaic kernels as the EP local matmul: the chip's expert slice is read from the placed w1 (E, I
    split by the sharding; a QArray's logical D), the declared bytes are the kernels' BlockSpec bytes at
    those local shapes × the routed layers (decode kernel for few tokens, the grouped kernels above), and
    the report prints them next to XLA's bytes."""
    from dsv4_jax.analysis import kernels_aot
    from dsv4_jax.analysis.aot import kernel_hook as K
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("expert", "model"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w1 = quant.abstract(quant.FP4, (2, 16, 128, 512), jnp.bfloat16, sh, sh)
    params = {"layers": {"ffn": {"experts": {"w1": w1}, "shared_experts": {"w1": None}}}}
    assert K.local_expert_dims(params) == (16, 128, 512)
    assert K.local_expert_dims({"ffn": {"shared_experts": {"w1": w1}}}) is None
    dec = K.ep_local_declared("release", 8, (16, 128, 512), 2, 3)
    s = kernels_aot.Shapes(n_experts=16, top_k=2, hidden=512, moe_inter=128)
    one = kernels_aot.blockspec_bytes(kernels_aot.Case("moe_decode", "fp4_e2m1_b32", tokens=8), s)["random"]
    assert dec["kernel"] == "moe_decode" and dec["declared_bytes"] == 3 * one["total"] > 0
    assert dec["ideal_bytes"] == 3 * one["ideal"]
    assert K.ep_local_declared("bf16", 64, (16, 128, 512), 2, 1)["kernel"] == "moe_prefill"
    run = {"programs": [{"program": "decode", "ep_kernel": dec, "cost": {"bytes_accessed": 5e9},
                         "hlo": {"top_ops": {"total_bytes": 2e9}}}, {"program": "verify"}]}
    rows = R.ep_kernel_rows(run)
    assert len(rows) == 1 and rows[0][0] == "decode" and rows[0][-3:] == ["5", "2", "—"]
    assert rows[0][6] == format(dec["declared_bytes"] / 1e9, ".3g")


def test_a_rounds_declared_bytes_hold_its_drafters_moe_calls():
    """Under the Mosaic local matmul a round's declared bytes are its target verify block's (k+1 tokens per
    sequence, every routed layer) plus its drafter's MoE calls, the passes its bound counts: MTP k − 1 chain
    steps of B tokens and one observe pass of B·(k+1); DSpark one block pass of B·γ per stage."""
    from dsv4_jax.analysis.aot import kernel_hook as K
    from dsv4_jax import backends as B
    import types
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "expert", "model"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w1 = quant.abstract(quant.FP4, (2, 16, 128, 512), jnp.bfloat16, sh, sh)
    cfg = runner.model_config("flash", pairs=0, small=True, platform="cpu").with_backends(
        B.Backends(moe="ep", ep=B.ExpertParallel(mesh, local="pallas_tpu")))
    shapes = types.SimpleNamespace(batch=2)
    params = {"layers": {"ffn": {"experts": {"w1": w1}}}}
    dec = lambda tokens, layers: K.ep_local_declared("release", tokens, (16, 128, 512), cfg.num_experts_per_tok,
                                                     layers, cfg.swiglu_limit)["declared_bytes"]
    verify = runner.ep_kernel_row(PR.Program("verify", None, (params,), {}, 4), cfg, "release", shapes, mesh)
    assert verify["declared_bytes"] == dec(8, cfg.num_layers) and "calls" not in verify
    mtp = runner.ep_kernel_row(PR.Program("spec-mtp", None, (params,), {}, 4, drafter_moe=(
        ("mtp chain", 1, 2), ("mtp observe", 4, 1))), cfg, "release", shapes, mesh)
    assert mtp["declared_bytes"] == dec(8, cfg.num_layers) + dec(2, 2) + dec(8, 1)
    assert [c["name"] for c in mtp["calls"]] == ["target", "mtp chain", "mtp observe"]
    ds = runner.ep_kernel_row(PR.Program("spec-dspark", None, (params,), {}, 4, drafter_moe=(("dspark block", 5, 3),)),
                              cfg, "release", shapes, mesh)
    assert ds["declared_bytes"] == dec(8, cfg.num_layers) + dec(10, 3)
    assert AC.kernels_declared_bytes({"ep_kernel": mtp, "hlo": {"top_ops": {"total_bytes": 5.0,
                                                                             "mosaic_call_bytes": 4.0}}}) == \
        1.0 + mtp["declared_bytes"]


def test_balanced_bound_counts_min_of_experts_and_picks():
    """The balanced bound reads min(E, T·k) experts per layer: equal to the uniform bound at one token; at
    T·k ≥ E every expert, i.e. the uniform bound less its routed-expert bytes plus the whole expert stacks
    (summed here from the parameter specs); a round adds its drafter passes to both alike."""
    cfg = scan_config(2, hidden=128)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    one = AB.target_bound(cfg, "bf16", 1, 64, 1)
    assert one["balanced"] == pytest.approx(one["total"], rel=1e-12)
    T = -(-E // k)                                     # tokens per sequence so that T·k ≥ E at batch 1
    many = AB.target_bound(cfg, "bf16", 1, 64, T)
    stacks = sum(2 * np.prod(s.shape) for path, s in P.flatten(P.param_specs(cfg)).items()
                 if path.split(".")[-1] in ("w1", "w2", "w3") and ".experts." in path)
    routed = traffic.bytes_bound(cfg, "bf16", 1, 64, T)["weight_parts"]["routed_experts"]
    assert routed < stacks                             # uniform routing leaves some experts idle
    assert many["balanced"] == pytest.approx(many["total"] - routed + stacks, rel=1e-9)
    mtp = AB.mtp_round_bound(cfg, "bf16", 2, 64, 3)
    assert mtp["balanced"] - mtp["total"] == pytest.approx(
        AB.target_bound(cfg, "bf16", 2, 64, 4)["balanced"] - mtp["target"], rel=1e-9)


def test_no_prefetch_options_per_generation():
    """VMEM prefetching off: v5e / v5p take the `vf` flag, v6e the `gf` one (libtpu 0.0.52); no option is
    known for v4 or the CPU backend, so no second compile there."""
    assert chips.no_prefetch_options(chips.parse("v6e:2x4").chip) == {"xla_gf_vmem_memory_space_assignment": False}
    for t in ("v5p:2x2x2", "v5e:4x4"):
        assert chips.no_prefetch_options(chips.parse(t).chip) == {"xla_vf_vmem_memory_space_assignment": False}
    assert chips.no_prefetch_options(chips.parse("v4:2x2x1").chip) is None
    assert chips.no_prefetch_options(chips.parse("cpu").chip) is None


def test_no_prefetch_compile_reported_next_to_the_default(monkeypatch, tmp_path):
    """With no_prefetch options the program as run is compiled once more with them merged into the run's
    options (here on the CPU backend, the option stripped before XLA sees it): the row carries its memory,
    costs and HLO-op bytes, the estimates their ratios to the uniform and balanced bounds, and the report a
    bytes-vs-bound table; the default compile's options stay unchanged."""
    seen, real = [], AC._compile

    def spy(program, options):
        seen.append(dict(options or {}))
        return real(program, {k: v for k, v in (options or {}).items() if k != "fake_msa"} or None)

    monkeypatch.setattr(AC, "_compile", spy)
    topo = chips.parse("cpu")
    mesh = parallel.make_mesh((1, 1, 1), chips.devices(topo))
    cfg = scan_config(0, hidden=128)
    row = AC.compile_program(PR.build("verify", cfg, mesh, "bf16", SHAPES), AC.Slice(topo.chip, 1, 16 * chips.GIB),
                             unrolled=False, opts=AC.CompileOptions(no_prefetch={"fake_msa": False}))
    assert seen == [{}, {"fake_msa": False}]
    q = row["no_prefetch"]
    assert q["options"] == {"fake_msa": False} and q["vmem_prefetches"] == 0 and q["hlo_op_bytes"] > 0
    assert q["cost_as_run"]["bytes_accessed"] > 0 and q["memory"]["peak"] > 0
    e, b = row["estimate"], row["bound"]
    assert b["balanced"] >= b["total"] * (1 - 1e-12)
    assert e["hlo_op_bytes_no_prefetch_over_bound"] == pytest.approx(q["hlo_op_bytes"] / b["total"])
    assert e["hlo_op_bytes_no_prefetch_over_bound_bal"] == pytest.approx(q["hlo_op_bytes"] / b["balanced"])
    assert e["hlo_op_bytes_over_bound_bal"] == pytest.approx(row["hlo"]["top_ops"]["total_bytes"] / b["balanced"])
    run_ = {"chips": 1, "programs": [row]}
    (line,) = R.bound_rows(run_)
    assert line[0] == "verify" and line[7] == f"{q['hlo_op_bytes'] / 1e9:.3g}" and line[10] == 0
    seen.clear()
    plain = AC.compile_program(PR.build("verify", cfg, mesh, "bf16", SHAPES), AC.Slice(topo.chip, 1, 16 * chips.GIB),
                               unrolled=False)
    assert len(seen) == 1 and "no_prefetch" not in plain
    assert "hlo_op_bytes_no_prefetch_over_bound" not in plain["estimate"]


def test_sharding_setup_takes_rule_overrides():
    """`ep.setup(..., rules)` updates the preset's rules (a placement study: one logical axis replicated), in
    the rules dict and in the EP backend's frozen rules alike."""
    devs = jax.devices()[:1]
    cfg = runner.model_config("flash", pairs=0, small=True, platform="cpu")
    _, base_cfg, _, base = EP.setup("latency", cfg, devs, 8)
    axis = next(a for a, v in base.items() if v)
    _, c, _, rules = EP.setup("latency", cfg, devs, 8, {axis: ()})
    assert rules[axis] == () and {a: v for a, v in rules.items() if a != axis} == \
        {a: v for a, v in base.items() if a != axis}
    assert dict(c.backends.ep.rules)[axis] == () and dict(base_cfg.backends.ep.rules)[axis] == base[axis]


@pytest.mark.slow
def test_libtpu_no_prefetch_compile_drops_the_prefetches():
    """Through libtpu for v6e:1x1: the default decode compile stages operands into VMEM (copy-starts), the
    compile with `chips.no_prefetch_options` keeps none, and its HLO-op bytes are reported."""
    if not libtpu.available():
        pytest.fail("this test needs libtpu (pip install libtpu)")
    topo = chips.parse("v6e:1x1")
    devs = chips.devices(topo)
    mesh = parallel.make_mesh((1, 1, 1), devs)
    row = AC.compile_program(PR.build("decode", scan_config(2, unroll=False), mesh, "bf16", SHAPES),
                             AC.Slice(topo.chip, 1, 31 * chips.GIB), unrolled=False,
                             opts=AC.CompileOptions(chips.TPU_COMPILE_OPTIONS,
                                                    no_prefetch=chips.no_prefetch_options(topo.chip)))
    assert row["compiled"] and row["hlo"]["vmem_prefetches"] > 0
    assert row["no_prefetch"]["vmem_prefetches"] == 0 and row["no_prefetch"]["hlo_op_bytes"] > 0


def test_placements_table_is_a_thin_caller_of_the_report():
    """`dsv4-aot placements` (`aot.placement_table`) only maps placement variants to dsv4-aot requests (a GSPMD
    mesh, or a sharding preset with its rules changed) and lays the report rows side by side; on the CPU backend
    one variant's report goes through it end to end."""
    a = PT.PlacementStudy(topology="cpu", weights="bf16", context=64, verify_tokens=3, pairs=0, count="scan",
                          vmem_prefetch="both")
    gspmd = PT.request("gspmd-tp", 1, ("decode",), a)
    assert gspmd.mesh == (1, 1, 8) and gspmd.sharding is None and gspmd.shapes.max_block == 3
    v1 = PT.request("latency-v1", 8, ("decode", "verify"), a)
    assert v1.sharding == "latency" and v1.rules and all(v == () for v in v1.rules.values())
    assert v1.programs == ("decode", "verify") and v1.vmem_prefetch == "both" and not v1.kernels
    req = runner.AotRequest(("cpu",), ("bf16",), I.Shapes(1, 64, 2, 8), scan_config(0, hidden=128),
                            programs=("decode", "verify"), kernels=False, count="scan")
    rep = runner.run(req, log=None)
    rows = PT.table_rows("cpu-test", rep)
    assert [r[1] for r in rows] == ["decode", "verify 3"] and all(len(r) == len(PT.HEAD) for r in rows)
    dec = rep["runs"][0]["programs"][0]
    assert rows[0][4] == f"{dec['hlo']['top_ops']['total_bytes'] / 1e9:.3g}" and rows[0][7] == "—"  # CPU: no 2nd compile
    assert rows[0][5] == f"{dec['estimate']['hlo_op_bytes_over_bound']:.2f}"
    assert "| cpu-test | verify 3 |" in PT.markdown(a, [("cpu-test", rep)])


def test_fit_table_subcommand_reads_saved_reports(capsys, tmp_path):
    """`dsv4-aot fit-table` (`aot.fit_summary`) compiles nothing: one row per saved program, with the flags that
    reproduce it."""
    path = os.path.join(os.path.dirname(HERE), "experiments", "results", "aot_2026-12-01_v5p-2x2x1_fp8.json")
    out = tmp_path / "rows.json"
    assert cli.main(["fit-table", path, "--reproduce", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rows and all(r["source"] == path for r in rows)
    assert text.count("| v5p") == len(rows) and "--topology v5p:2x2x1" in text
    assert FS.key_flags("dsv4-aot --topology v6e:2x4 --batch 8 --out x.json") == "--topology v6e:2x4 --batch 8"


MOSAIC = """HloModule m, is_scheduled=true

ENTRY %main (p0: u8[64,128,256], p1: f32[8,256]) -> f32[8,128] {
  %p0 = u8[64,128,256]{2,1,0} parameter(0)
  %p1 = f32[8,256]{1,0} parameter(1)
  %neg = f32[8,256]{1,0} negate(%p1)
  ROOT %cc = f32[8,128]{1,0} custom-call(%neg, %p0), custom_call_target="tpu_custom_call"
}
"""


def test_mosaic_calls_counted_as_their_kernels_declare():
    """A Pallas TPU kernel call's operands are counted whole by the HLO-op bytes (here a u8 expert stack);
    with the EP kernels' declared bytes the estimate replaces the call's bytes by them (the HBM figure the
    roofline uses) — a round's too once they hold its drafter's calls, not a round of an older report whose
    declared bytes were its verify block's only ("scope")."""
    top = hlo.analyse(MOSAIC)["top_ops"]
    call = 64 * 128 * 256 + 8 * 256 * 4 + 8 * 128 * 4
    assert top["mosaic_call_bytes"] == call and top["total_bytes"] == call + 2 * 8 * 256 * 4
    row = {"hlo": {"top_ops": top}, "ep_kernel": {"declared_bytes": 1e4}, "bound": {"total": 8e4},
           "cost": {"flops": 1.0}}
    assert AC.kernels_declared_bytes(row) == 2 * 8 * 256 * 4 + 1e4
    e = AC.estimates(row, chips.CPU, 2)
    assert e["hlo_op_bytes_kernels_declared"] == 2 * 8 * 256 * 4 + 1e4
    assert e["hlo_op_bytes_over_bound"] == pytest.approx((2 * 8 * 256 * 4 + 1e4) / 4e4)
    assert e["hlo_op_bytes_whole_kernel_operands"] == top["total_bytes"]
    rnd = dict(row, ep_kernel={"declared_bytes": 3e4, "calls": [{"name": "target"}, {"name": "mtp chain"}]})
    assert AC.kernels_declared_bytes(rnd) == 2 * 8 * 256 * 4 + 3e4
    rnd = dict(row, ep_kernel={"declared_bytes": 1e4, "scope": "target verify block only"})
    assert AC.kernels_declared_bytes(rnd) is None
    assert AC.estimates(rnd, chips.CPU, 2)["hlo_op_bytes_over_bound"] == pytest.approx(top["total_bytes"] / 4e4)
