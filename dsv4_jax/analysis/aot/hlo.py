"""Reading a compiled program's HLO text: instructions, the bytes each moves, collectives.

`parse(text)` splits an HLO module (`Compiled.as_text()`) into computations of instructions (name, result
shape, opcode, operand names, attributes). On top of it:

  * `op_bytes`: the bytes a top-level instruction moves between memory and the core — its HBM operands plus
    its HBM result — with XLA's own refinements for partial accesses: an operand a fusion reads only
    through slice / dynamic-slice / gather (also behind a nested fusion that only re-lays it out) counts
    what those read, an async slice (`slice-start`, or an `async-start` calling a slice) the slice, a
    SparseCore gather offload (`gather_offload_*`) the rows it returns, an in-place dynamic-update-slice or
    scatter counts the update it writes, not the whole buffer. Arrays in on-chip memory spaces (layout
    `S(n)`, n ≠ 0: TPU VMEM / SMEM) are not HBM traffic and count 0. Layout padding is ignored.
  * `top_ops`: the top-level instructions of the entry computation (and of the computations it calls
    through while / conditional / call) by bytes, and the same grouped by the JAX operation that made them
    (`op_name` metadata with layer numbers and unique suffixes folded); "mosaic_call_bytes" = the part of
    the total in Pallas TPU kernel calls (operands counted whole: an over-count, `is_mosaic_call`).
  * `collectives`: every all-reduce / all-gather / all-to-all / reduce-scatter / collective-permute (and
    their async `-start` forms), with operand and result bytes and replica groups, per opcode.
  * `vmem_prefetches`: the copy-start instructions (XLA:TPU's copies of operands into VMEM ahead of use).
  * `launches`: the ops a TPU runs one after another, each with its own start-up cost — fusions, custom calls
    (Mosaic kernels) and the other top-level ops of the executed computations, collectives apart — per
    kind; the latency-aware roofline (`compile.estimates`) charges each a launch overhead.
A `while` body appears once in the text: its instructions are counted once (the AOT report unrolls the
layer scans so that every layer appears).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

ELEMENT_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                 "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                 "c128": 16, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
# no data movement of their own (aliases, bookkeeping, the second half of async pairs)
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain", "iota"}
_SLICING = {"slice", "dynamic-slice", "gather"}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def element_bytes(dtype: str) -> float:
    if dtype in ELEMENT_BYTES:
        return ELEMENT_BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    if dtype.startswith("f4"):
        return 0.5
    raise ValueError(f"unknown HLO element type {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0

    @property
    def nbytes(self) -> float:
        n = 1
        for d in self.dims:
            n *= d
        return n * element_bytes(self.dtype)


def arrays(shape: str) -> list[Array]:
    """The arrays of a (possibly tuple) HLO shape string, with their memory spaces."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        m = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(m.group(1)) if m else 0))
    return out


def hbm_bytes(shape: str) -> float:
    return sum(a.nbytes for a in arrays(shape) if a.memory_space == 0)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    param: int | None = None      # parameter number of a `parameter` instruction
    literal: str | None = None    # the value text of a `constant`

    def attr(self, key: str) -> str | None:
        """Value of `key=...` (a %name, {...} group or token)."""
        m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attrs)
        if not m:
            return None
        rest = self.attrs[m.end():]
        if rest.startswith("{"):
            return rest[:_balanced(rest, 0, "{", "}") + 1]
        if rest.startswith('"'):
            end = rest.index('"', 1)
            return rest[1:end]
        mesh = re.match(r"mesh\[[^\]]*\]\s*\{[^}]*\}", rest)        # mesh['x'=4,'y'=2] {'x'} groups
        if mesh:
            return mesh.group(0)
        iota = re.match(r"\[[0-9,]*\](?:<=\[[0-9,]*\](?:T\([0-9,]*\))?)?", rest)   # [2,4]<=[8] groups
        if iota:
            return iota.group(0)
        return re.match(r"[^,\s]*", rest).group(0)

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def called(self) -> list[str]:
        """Computations this instruction calls (fusion body, while body/condition, branches, to_apply)."""
        out = []
        for key in ("calls", "body", "condition", "to_apply"):
            v = self.attr(key)
            if v:
                out.extend(n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", v.strip("{}")))
        v = self.attr("branch_computations")
        if v:
            out.extend(n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", v.strip("{}")))
        return out


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction]

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}

    @property
    def root(self) -> Instruction:
        for i in self.instructions:
            if i.root:
                return i
        return self.instructions[-1]


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]

    @property
    def entry(self) -> Computation:
        for c in self.computations.values():
            if c.entry:
                return c
        raise ValueError("HLO module has no ENTRY computation")


def _balanced(s: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index of the bracket closing the one at s[start]."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] == open_:
            depth += 1
        elif s[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_}{close} in HLO: {s[start:start + 80]!r}")


def _split_top(s: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        sm = re.match(r"[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?", rest)
        if not sm:
            return None
        shape, rest = sm.group(0), rest[sm.end():].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    end = _balanced(rest, om.end() - 1)
    inner, attrs = rest[om.end():end], rest[end + 1:].lstrip(", ")
    operands = []
    param = int(inner) if opcode == "parameter" and inner.strip().isdigit() else None
    literal = inner.strip() if opcode == "constant" else None
    if opcode not in ("constant", "parameter"):
        for tok in _split_top(inner):
            names = re.findall(r"%([\w.\-]+)", tok)
            if names:
                operands.append(names[-1])
            elif re.fullmatch(r"[\w.\-]+", tok):
                operands.append(tok)
    return Instruction(name, shape, opcode, operands, attrs, root, param, literal)


def parse(text: str) -> Module:
    """Parse HLO module text into computations of instructions."""
    comps: dict[str, Computation] = {}
    cur_name, cur_entry, cur = None, False, []
    for line in text.splitlines():
        if cur_name is None:
            m = _COMP_HEAD.match(line)
            if m:
                cur_name, cur_entry, cur = m.group(2), bool(m.group(1)), []
            continue
        if line.startswith("}"):              # "}" or "}, execution_thread=..." (TPU SparseCore computations)
            comps[cur_name] = Computation(cur_name, cur_entry, cur)
            cur_name = None
            continue
        ins = parse_instruction(line)
        if ins is not None:
            cur.append(ins)
    if not comps:
        raise ValueError("no computations found in the HLO text")
    return Module(comps)


# ---- bytes per instruction ---------------------------------------------------------------------------

def logical_bytes(shape: str) -> float:
    """Bytes of every array of a shape, whatever its memory space."""
    return sum(a.nbytes for a in arrays(shape))


def _roots(body: Computation) -> list[Instruction]:
    r = body.root
    return [body.by_name[o] for o in r.operands if o in body.by_name] if r.opcode == "tuple" else [r]


def _update_operand(ins: Instruction) -> str | None:
    """The update a dynamic-update-slice / scatter writes (None for other opcodes)."""
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return ins.operands[1]
    if ins.opcode == "scatter" and ins.operands:
        return ins.operands[-1]
    return None


def _in_place_buffers(body: Computation) -> set[str]:
    """Parameters of a fused computation that its root dynamic-update-slices / scatters update in place."""
    out = set()
    for r in _roots(body):
        if _update_operand(r) is not None:
            src = body.by_name.get(r.operands[0])
            if src is not None and src.opcode == "parameter":
                out.add(src.name)
    return out


def _fusion_read(module: Module, comp: Computation, fusion: Instruction) -> float:
    """HBM bytes a fusion reads: per HBM operand the whole array, or only what slices of it read, or
    nothing for a buffer the fusion updates in place."""
    body = module.computations.get(fusion.called[0]) if fusion.called else None
    if body is None:
        return sum(hbm_bytes(comp.by_name[o].shape) for o in fusion.operands if o in comp.by_name)
    param = {ins.param: ins for ins in body.instructions if ins.opcode == "parameter"}
    in_place = _in_place_buffers(body)
    total = 0.0
    for k, op in enumerate(fusion.operands):
        src = comp.by_name.get(op)
        if src is None:
            continue
        full = hbm_bytes(src.shape)
        p = param.get(k)
        if p is None or full == 0:
            total += full
            continue
        if p.name in in_place:
            continue
        sliced = _sliced_bytes(module, body, p.name)
        total += full if sliced is None else min(full, sliced)
    return total


def _users(body: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = defaultdict(list)
    for ins in body.instructions:
        for o in ins.operands:
            users[o].append(ins)
    return users


def _layout_copy(module: Module, ins: Instruction) -> bool:
    """A nested fusion that only re-lays out its one operand (parameter -> copy / bitcast, e.g. XLA:TPU's
    `copy_fusion` re-tiling an 8-bit stack): inside a fusion it is computed per element on demand, not written."""
    body = module.computations.get(ins.called[0]) if ins.opcode == "fusion" and ins.called else None
    return (body is not None and len(ins.operands) == 1 and
            all(i.opcode in ("parameter", "copy", "bitcast") for i in body.instructions))


def _sliced_bytes(module: Module, body: Computation, name: str, depth: int = 0) -> float | None:
    """Bytes read from `name` in the fused computation `body` when every use slices it — directly, behind a
    nested fusion that only re-lays it out, or inside a nested fusion that slices it; None when some use
    reads it whole."""
    us = _users(body).get(name, []) if depth < 8 else []
    if not us:
        return None
    total = 0.0
    for u in us:
        if u.opcode in _SLICING and u.operands[0] == name:
            b = logical_bytes(u.shape)
        elif _layout_copy(module, u):
            b = _sliced_bytes(module, body, u.name, depth + 1)
        elif u.opcode == "fusion" and u.called and u.called[0] in module.computations:
            inner = module.computations[u.called[0]]
            params = {i.param: i.name for i in inner.instructions if i.opcode == "parameter"}
            b = 0.0
            for j, o in enumerate(u.operands):
                if o == name:
                    bj = _sliced_bytes(module, inner, params[j], depth + 1) if j in params else None
                    b = None if bj is None or b is None else b + bj
        else:
            b = None
        if b is None:
            return None
        total += b
    return total


def _fusion_written(module: Module, ins: Instruction) -> float:
    """HBM bytes a fusion writes: its HBM results, an in-place update counting only the update."""
    body = module.computations.get(ins.called[0]) if ins.called else None
    results = arrays(ins.shape)
    roots = _roots(body) if body is not None else []
    if len(roots) != len(results):
        return hbm_bytes(ins.shape)
    total = 0.0
    for r, a in zip(roots, results):
        if a.memory_space != 0:
            continue
        upd = _update_operand(r)
        total += logical_bytes(body.by_name[upd].shape) if upd in body.by_name else a.nbytes
    return total


def op_bytes(module: Module, comp: Computation, ins: Instruction) -> float:
    """HBM bytes one instruction of `comp` moves (see the module docstring); 0 for bookkeeping ops."""
    if ins.opcode in _FREE or ins.opcode.endswith("-done") or ins.opcode in ("while", "conditional", "call"):
        return 0.0
    shape_of = lambda o: hbm_bytes(comp.by_name[o].shape) if o in comp.by_name else 0.0
    if ins.opcode == "fusion":
        return _fusion_read(module, comp, ins) + _fusion_written(module, ins)
    if ins.opcode in _SLICING:            # reads what it returns from an HBM source (+ indices)
        src_in_hbm = bool(ins.operands) and shape_of(ins.operands[0]) > 0
        return (logical_bytes(ins.shape) if src_in_hbm else 0.0) + hbm_bytes(ins.shape) + \
            sum(shape_of(o) for o in ins.operands[1:])
    upd = _update_operand(ins)
    if upd is not None:                   # in place: reads the update and indices, writes the update
        return sum(shape_of(o) for o in ins.operands[1:]) + shape_of(upd)
    if ins.opcode == "slice-start" or _async_slice(module, ins):   # async slice: reads the slice it returns
        src_in_hbm = bool(ins.operands) and shape_of(ins.operands[0]) > 0
        return (sum(a.nbytes for a in _async_results(comp, ins)) if src_in_hbm else 0.0) + _async_written(comp, ins)
    if _gather_offload(module, ins):      # SparseCore gather: reads the rows it returns (+ indices), not the table
        data = [o for o in ins.operands if o in comp.by_name and not comp.by_name[o].opcode.startswith("async")]
        table = max(data, key=shape_of, default=None)
        rows = hbm_bytes(ins.shape) if ins.opcode == "custom-call" else \
            sum(a.nbytes for a in _async_results(comp, ins) if a.memory_space == 0)
        return (2 if table else 1) * rows + sum(shape_of(o) for o in data if o != table)   # no table: scratch
    read = sum(shape_of(o) for o in ins.operands)
    if ins.opcode.endswith("-start"):
        return read + _async_written(comp, ins)
    return read + hbm_bytes(ins.shape)


def _async_slice(module: Module, ins: Instruction) -> bool:
    """An `async-start` whose called computation is a slice of its one parameter (XLA:TPU's async copies
    of a slice of a weight buffer into VMEM)."""
    if ins.opcode != "async-start" or not ins.called or ins.called[0] not in module.computations:
        return False
    body = module.computations[ins.called[0]]
    root = body.root
    return root.opcode in _SLICING and all(i.opcode == "parameter" for i in body.instructions if i is not root)


def _gather_offload(module: Module, ins: Instruction) -> bool:
    """A gather offloaded to the SparseCore (XLA:TPU `gather_offload_*`): its async pair or the custom-call
    wrapping it. Those take the whole table as an operand but read only the rows they return."""
    if ins.opcode not in ("async-start", "async-update", "custom-call"):
        return False
    if "gather_offload" in ins.name:
        return True
    names = list(ins.called) + re.findall(r"%([\w.\-]+)", ins.attr("called_computations") or "")
    return any(any("gather_offload" in i.name for i in module.computations[n].instructions)
               for n in names if n in module.computations)


def _async_written(comp: Computation, ins: Instruction) -> float:
    """HBM bytes an async `-start` writes: its result tuple holds the operands again (aliases) next to the
    output and small context scalars; count the arrays left after removing one equal array per operand."""
    return sum(a.nbytes for a in _async_results(comp, ins) if a.memory_space == 0)


def _async_results(comp: Computation, ins: Instruction) -> list[Array]:
    """The arrays an async `-start` makes: its result tuple less one equal array per operand (the aliased
    operands) and scalar context words."""
    left = [a for a in arrays(ins.shape) if a.dims]
    for o in ins.operands:
        if o not in comp.by_name:
            continue
        for a in arrays(comp.by_name[o].shape):
            if a in left:
                left.remove(a)
    return left


_CONTROL = ("while", "conditional", "call", "call-start", "async-start")
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _int_constant(comp: Computation, name: str) -> int | None:
    """The integer value of `name` in `comp` when it is a scalar constant (through copies / bitcasts)."""
    ins = comp.by_name.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    if ins is None or ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.literal or ""):
        return None
    return int(ins.literal)


def trip_count(module: Module, comp: Computation, loop: Instruction) -> int | None:
    """Iterations of a `while` instruction of `comp`: XLA's known_trip_count when given, else read from a
    condition `counter <cmp> constant` whose counter starts from a constant in the loop's init tuple."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if m:
        return int(m.group(1))
    cond = module.computations.get((loop.attr("condition") or "").lstrip("%"))
    if cond is None or cond.root.opcode != "compare" or len(cond.root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", cond.root.attrs)
    direction = direction.group(1) if direction else ""
    a, b = (cond.by_name.get(o) for o in cond.root.operands)
    if a is None or b is None:
        return None
    if a.opcode == "constant":                       # constant <cmp> counter: swap the sides
        a, b, direction = b, a, _FLIP.get(direction, "")
    limit = _int_constant(cond, b.name)
    if a.opcode != "get-tuple-element" or limit is None:
        return None
    index = int(re.search(r"index=(\d+)", a.attrs).group(1))
    init = comp.by_name.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _int_constant(comp, init.operands[index])
    if start is None:
        return None
    trips = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1}.get(direction)
    return max(trips, 0) if trips is not None else None


def executions(module: Module) -> tuple[dict[str, int], list[dict]]:
    """How many times each computation runs per call of the program: entry 1, a while body its caller's
    count × the trip count, every other callee (fusion bodies, branches, async calls) its callers' sum.
    Returns ({computation: count}, loops [{"body", "trips" (None: unknown, counted once)}])."""
    counts: dict[str, int] = defaultdict(int)
    loops = []
    counts[module.entry.name] = 1
    order, seen = [], set()

    def visit(name):                                 # callers before callees (reverse post-order)
        if name in seen or name not in module.computations:
            return
        seen.add(name)
        for ins in module.computations[name].instructions:
            for callee in ins.called:
                visit(callee)
        order.append(name)

    visit(module.entry.name)
    for name in reversed(order):
        comp, n = module.computations[name], counts.get(name, 0)
        if not n:
            continue
        for ins in comp.instructions:
            if ins.opcode == "while":
                trips = trip_count(module, comp, ins)
                body = (ins.attr("body") or "").lstrip("%")
                cond = (ins.attr("condition") or "").lstrip("%")
                loops.append({"body": body, "trips": trips, "op_name": ins.op_name[-120:]})
                counts[body] += n * (trips if trips is not None else 1)
                counts[cond] += n * ((trips + 1) if trips is not None else 1)
            else:
                for callee in ins.called:
                    counts[callee] += n
    return dict(counts), loops


def executed_computations(module: Module, scale_loops: bool = False) -> list[tuple[Computation, int]]:
    """The computations that run as control flow — the entry and what it runs through while / conditional /
    call / async calls, not fusion bodies (their bytes belong to the fusion) — each with how many times it
    runs (1 each unless scale_loops: while bodies × their trip counts)."""
    counts, _ = executions(module)
    out, todo, seen = [], [module.entry.name], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        comp = module.computations[name]
        out.append((comp, counts.get(name, 1) if scale_loops else 1))
        for ins in comp.instructions:
            if ins.opcode in _CONTROL:
                todo.extend(ins.called)
    return out


_NUM = re.compile(r"\d+")


def op_group(ins: Instruction) -> str:
    """The JAX operation an instruction came from, layer numbers and duplicates folded: metadata op_name
    without its leading jit(...) frames, digits replaced by '#'; the opcode when there is no metadata."""
    name = ins.op_name
    if not name:
        return ins.opcode
    parts = [p for p in name.split("/") if not p.startswith("jit(")]
    return _NUM.sub("#", "/".join(parts) or name)


def top_ops(module: Module, n: int = 15, scale_loops: bool = False) -> dict:
    """{"ops": n largest instructions by bytes, "groups": n largest op groups, "total_bytes": sum,
    "instructions": executed instructions}. scale_loops: an instruction in a while body counts its
    bytes × the loop's trip count ("runs")."""
    rows, mosaic = [], 0.0
    for comp, runs in executed_computations(module, scale_loops):
        for ins in comp.instructions:
            b = op_bytes(module, comp, ins)
            if b > 0 and is_mosaic_call(ins):
                mosaic += b * runs
            if b > 0:
                kind = ins.attr("kind") if ins.opcode == "fusion" else None
                rows.append({"name": ins.name, "opcode": ins.opcode + (f"/{kind}" if kind else ""),
                             "bytes": b * runs, "runs": runs, "shape": _short(ins.shape),
                             "op_name": ins.op_name[-160:], "group": op_group(ins), "computation": comp.name})
    total = sum(r["bytes"] for r in rows)
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"group": r["group"], "count": 0, "bytes": 0.0})
        g["count"] += r["runs"]
        g["bytes"] += r["bytes"]
    top = sorted(rows, key=lambda r: -r["bytes"])[:n]
    top_groups = sorted(groups.values(), key=lambda g: -g["bytes"])[:n]
    for r in top + top_groups:
        r["share"] = r["bytes"] / total if total else 0.0
    return {"ops": top, "groups": top_groups, "total_bytes": total, "instructions": sum(r["runs"] for r in rows),
            "mosaic_call_bytes": mosaic}


def is_mosaic_call(ins: Instruction) -> bool:
    """A Pallas TPU (Mosaic) kernel call: its operands are counted whole by `op_bytes`, though the kernel's
    BlockSpecs may read a small part of them (the MoE decode kernel: the active experts' tiles of a layer
    stack); what it really moves is what its BlockSpecs declare (`kernel_hook.ep_local_declared`)."""
    return ins.opcode == "custom-call" and ins.attr("custom_call_target") == "tpu_custom_call"


def _short(shape: str, limit: int = 120) -> str:
    s = re.sub(r"\{[^}]*\}", "", shape)
    return s if len(s) <= limit else s[:limit] + "…"


def _group_size(replica_groups: str | None) -> int | None:
    """Devices per group of a replica_groups attribute: {{0,1},{2,3}}, iota [G,S]<=[N], or mesh axes."""
    if not replica_groups:
        return None
    m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", replica_groups)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        names = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(sizes.get(n, 1) for n in names) if names else None
    m = re.match(r"\[([0-9,]+)\]<=", replica_groups)
    if m:
        return int(m.group(1).split(",")[-1])
    first = re.search(r"\{([0-9,]*)\}", replica_groups.strip()[1:] if replica_groups.startswith("{{") else
                      replica_groups)
    return len([v for v in first.group(1).split(",") if v]) if first else None


def collectives(module: Module, scale_loops: bool = False) -> dict:
    """Collectives of the module: {"ops": [...], "by_opcode": {opcode: {count, operand_bytes, result_bytes}},
    "total_operand_bytes", "count"}. Operand bytes are the per-device arrays each collective sends in;
    scale_loops: one in a while body counts × the trip count ("runs")."""
    ops = []
    counts = executions(module)[0] if scale_loops else {}
    for comp in module.computations.values():
        runs = counts.get(comp.name, 0) if scale_loops else 1
        if not runs:
            continue
        for ins in comp.instructions:
            base = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
            if base not in COLLECTIVES:
                continue
            operand = sum(hbm_bytes(comp.by_name[o].shape) if o in comp.by_name else 0.0 for o in ins.operands)
            operand = operand or sum(a.nbytes for o in ins.operands if o in comp.by_name
                                     for a in arrays(comp.by_name[o].shape))
            result = sum(a.nbytes for a in arrays(ins.shape))
            if ins.opcode.endswith("-start") and base in ("all-reduce", "collective-permute"):
                result = operand   # async start shapes hold (operand, result) or aliases: count the data once
            groups = ins.attr("replica_groups") or ins.attr("source_target_pairs")
            ops.append({"opcode": base, "name": ins.name, "computation": comp.name, "runs": runs,
                        "operand_bytes": operand * runs, "result_bytes": result * runs, "shape": _short(ins.shape),
                        "replica_groups": (groups or "")[:80], "group_size": _group_size(ins.attr("replica_groups")),
                        "op_name": ins.op_name[-160:]})
    by: dict[str, dict] = {}
    for o in ops:
        b = by.setdefault(o["opcode"], {"count": 0, "operand_bytes": 0.0, "result_bytes": 0.0})
        b["count"] += o["runs"]
        b["operand_bytes"] += o["operand_bytes"]
        b["result_bytes"] += o["result_bytes"]
    ops.sort(key=lambda o: -o["operand_bytes"])
    return {"ops": ops[:50], "by_opcode": by, "total_operand_bytes": sum(o["operand_bytes"] for o in ops),
            "count": sum(o["runs"] for o in ops)}


def vmem_prefetches(module: Module) -> int:
    """copy-start instructions in the module text (XLA:TPU's prefetches into VMEM; each written once)."""
    return sum(ins.opcode == "copy-start" for comp in module.computations.values() for ins in comp.instructions)


def _launched(ins: Instruction) -> str | None:
    """The kind of op `ins` launches on its own ("fusion", "custom-call", "other"); None for bookkeeping, control
    flow, the second halves of async pairs (`-done`, `-update`) and collectives (priced per collective)."""
    op = ins.opcode
    if op in _FREE or op in ("while", "conditional", "call") or op.endswith(("-done", "-update")):
        return None
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in COLLECTIVES:
        return None
    return op if op in ("fusion", "custom-call") else "other"


def _async_called(module: Module) -> set[str]:
    """Computations run through async-start / call-start: their ops belong to that one launched op."""
    return {c for comp in module.computations.values() for ins in comp.instructions
            if ins.opcode in ("async-start", "call-start") for c in ins.called}


def launches(module: Module, scale_loops: bool = False) -> dict:
    """Ops launched separately per call of the program: {"count", "by_kind": {"fusion", "custom-call", "other":
    count}}, over the executed computations (`executed_computations`: not fusion bodies, not the computations
    an async-start runs, which count as that one op; `_launched` for what counts). scale_loops: an op in a
    while body counts × the loop's trip count (its condition's ops × trips + 1), as `top_ops` scales bytes."""
    skip = _async_called(module)
    by = {"fusion": 0, "custom-call": 0, "other": 0}
    for comp, runs in executed_computations(module, scale_loops):
        if comp.name in skip:
            continue
        for ins in comp.instructions:
            kind = _launched(ins)
            if kind is not None:
                by[kind] += runs
    return {"count": sum(by.values()), "by_kind": by}


def analyse(text: str, top: int = 15, scale_loops: bool = False) -> dict:
    """Top ops and collectives of HLO module text; scale_loops counts while bodies × their trip counts
    (the loops found, with trip counts or None when unknown, are in "loops")."""
    module = parse(text)
    out = {"top_ops": top_ops(module, top, scale_loops), "collectives": collectives(module, scale_loops),
           "scale_loops": scale_loops, "vmem_prefetches": vmem_prefetches(module),
           "launches": launches(module, scale_loops)}
    if scale_loops:
        out["loops"] = executions(module)[1]
    return out
