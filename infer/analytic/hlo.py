"""Reading XLA's HLO text: the computations of a module and their instructions, the bytes of a
shape (all of it, or only what lives in HBM), the launches of a compiled program (count_kernels),
where a pre-optimisation program's bytes go by instruction kind (breakdown), and the trips of a
while loop whose condition is `i < N` (counted_trips)."""
from __future__ import annotations

import re
import warnings

# instructions that launch no work: they name, bundle or reinterpret buffers
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier"}
_OP = re.compile(r"=\s*(?:\S+\s+)?([a-z][a-z0-9\-]*)\(")


def count_kernels(hlo_text: str) -> int:
    """Instructions of the ENTRY computation and of while / conditional bodies (each counted once)
    that launch work: fusions, library calls, copies, collectives."""
    comps, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s) and not s.startswith("ROOT"):
            name = "ENTRY" if s.startswith("ENTRY") else s.split()[0].lstrip("%")
            lines = []
        elif s == "}" and name is not None:
            comps[name] = lines
            name = None
        elif name is not None and " = " in s:
            lines.append(s)
    wanted = {"ENTRY"}
    for body in comps.get("ENTRY", []):
        for key in ("body=", "condition=", "branch_computations={", "true_computation=", "false_computation="):
            for m in re.finditer(re.escape(key) + r"%?([\w.\-]+)", body):
                wanted.add(m.group(1))
    total = 0
    for c in wanted:
        for s in comps.get(c, []):
            m = _OP.search(s)
            if m and m.group(1) not in FREE:
                total += 1
    return total


# ---- shapes and instructions ----------------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32|f64|s64|u64)\[([0-9,]*)\]")
_LAYOUT_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32|f64|s64|u64)\[([0-9,]*)\](\{[^}]*\})?")
_INST = re.compile(r"(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")


def _elements(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def array_bytes(shape_text: str) -> int:
    """Bytes of all the arrays in `shape_text` (one shape or a tuple of them)."""
    return sum(_elements(dims) * _DTYPE_BYTES[dt] for dt, dims in _SHAPE.findall(shape_text))


def hbm_bytes(shape_text: str) -> int:
    """Bytes of the arrays in `shape_text` that live in HBM: not those a layout puts in another
    memory space (`S(n)`: on TPU, S(1) is the core's vector memory, S(2) scalar memory)."""
    total = 0
    for dt, dims, layout in _LAYOUT_SHAPE.findall(shape_text):
        if re.search(r"S\([1-9]\d*\)", layout or ""):
            continue
        total += _elements(dims) * _DTYPE_BYTES[dt]
    return total


def computations(hlo_text: str) -> dict:
    """{computation name ("ENTRY" for the entry): [instruction]}, each instruction a dict of its
    name, shape (text), op, operand names (args) and line."""
    comps, cur = {}, None
    for line in hlo_text.splitlines():
        s = _INDEX_COMMENT.sub("", line.strip())  # (long operand and tuple lists carry /*index=N*/ marks)
        if s.endswith("{") and " = " not in s:
            name = s.split()[1] if s.startswith("ENTRY") else s.split()[0]
            cur = comps.setdefault("ENTRY" if s.startswith("ENTRY") else name.lstrip("%"), [])
        elif s == "}":
            cur = None
        elif cur is not None and (m := _INST.match(s)):
            name, shape, op, rest = m.groups()
            args = [a.strip().lstrip("%") for a in rest.split(")")[0].split(",") if a.strip()]
            cur.append(dict(name=name, shape=shape, op=op, args=args, line=s))
    return comps


def callee(ins: dict, key: str = "calls") -> str:
    """The computation an instruction names with `key=` (calls, to_apply, body, condition)."""
    return re.search(key + r"=%?([\w.\-]+)", ins["line"]).group(1)


# ---- where the bytes go: the lowered program's instructions by kind ---------------------------

_MOVES = {"slice", "dynamic-slice", "gather", "scatter", "dynamic-update-slice", "concatenate", "transpose",
          "broadcast", "pad", "reverse", "copy", "reshape"}
KINDS = ("matmul", "kernel", "reduce", "data movement", "elementwise")  # breakdown classes, in report order


def breakdown(hlo_text: str) -> dict:
    """Bytes of a pre-optimisation HLO module by instruction kind (matmul = dot / convolution,
    kernel = custom calls (Pallas kernels: operands + results, all of the cache), reduce, data
    movement = slices, gathers, scatters, concatenations, transposes, broadcasts, reshapes,
    elementwise = the rest), each instruction's operands + result as XLA's cost analysis counts
    them (slices and gathers: the part read; updates: the part written), calls followed into their
    computations. An approximation of `cost_analysis()["bytes accessed"]` that says where it goes:
    a fusing compiler (XLA on GPU/TPU) keeps most elementwise, broadcast and reduce traffic in
    registers, so "matmul" is near what such a round must read."""
    comps = computations(hlo_text)
    out = dict.fromkeys(KINDS, 0.0)

    def walk(comp):
        sizes = {}
        for ins in comps.get(comp, []):
            name, op, args = ins["name"], ins["op"], ins["args"]
            res = sizes[name] = array_bytes(ins["shape"])
            if op in FREE:
                continue
            if op == "call":
                walk(callee(ins, "to_apply"))
                continue
            read = sum(sizes.get(a, 0) for a in args)
            if op in ("slice", "dynamic-slice"):  # the part read, as XLA counts them
                read = res
            elif op == "gather":  # the rows read and the indices
                read = res + sizes.get(args[1], 0)
            elif op == "dynamic-update-slice":  # the part written
                read, res = 2 * (read - sizes.get(args[0], 0)), 0
            elif op == "scatter":  # updates read, read back and written, and the indices
                read, res = 3 * sizes.get(args[2], 0) + sizes.get(args[1], 0), 0
            kind = ("matmul" if op in ("dot", "convolution") else "kernel" if op == "custom-call"
                    else "reduce" if op.startswith("reduce")
                    else "data movement" if op in _MOVES else "elementwise")
            out[kind] += read + res
    walk("ENTRY")
    return out


# ---- while loops ----------------------------------------------------------------------------------

def _constant(body, name):
    ins = next((i for i in body if i["name"] == name and i["op"] == "constant"), None)
    m = re.search(r"constant\((-?\d+)\)", ins["line"]) if ins else None
    return int(m.group(1)) if m else None


def counted_trips(comps: dict, caller: list, loop: dict) -> int:
    """Trips of a while loop (`loop`, an instruction of `caller`) whose condition is `i < N` (or
    `N > i`) for a constant N, i a loop-state element that starts at a constant (a scan or fori loop
    stepping by 1, as JAX writes them; XLA's TPU compiler leaves no known_trip_count on them): N
    minus the start (0 if the start is not a visible constant). Otherwise 1, with a warning."""
    body = comps.get(callee(loop, "condition"), [])
    root = body[-1] if body else None
    if root is not None and root["op"] == "compare" and len(root["args"]) == 2:
        counter, bound = root["args"]
        if "direction=GT" in root["line"]:
            counter, bound = bound, counter
        n = _constant(body, bound) if re.search(r"direction=(LT|GT)", root["line"]) else None
        if n is not None:
            gte = next((i for i in body if i["name"] == counter and i["op"] == "get-tuple-element"), None)
            k = re.search(r"index=(\d+)", gte["line"]) if gte else None
            init = next((i for i in caller if loop["args"] and i["name"] == loop["args"][0]), None)
            start = _constant(caller, init["args"][int(k.group(1))]) if (
                k and init is not None and init["op"] == "tuple" and int(k.group(1)) < len(init["args"])) else None
            return max(n - (start or 0), 0)
    warnings.warn(f"while loop {loop['name']}: no known trip count and no `i < N` condition; counted once")
    return 1
