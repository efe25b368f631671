"""What a compiled (optimised, fused) program moves to and from HBM, kernel by kernel (hbm_traffic),
counted all in HBM -- the compiled bound -- or, for a GPU, with a rule for what stays in its L2
(`_L2`) and a floor under each kernel's time (GPU_KERNEL_FLOOR_S): both estimates, not measured."""
from __future__ import annotations

import re

from .hlo import FREE, array_bytes, computations, counted_trips, hbm_bytes

# What a small GPU kernel costs whatever it moves (launch inside a CUDA graph, ramp-up, tail), for the
# compiled GPU rows' kernel-floor estimate: fitted to one measured run of a small model (a plain step's
# and a round's times against their kernels and FLOPs: two times, two unknowns, no bytes term, so the
# floor also absorbs that run's weight reads), to be replaced by a profile when a GPU is lent. The run
# and its figures are in docs/performance.md, not here: a figure copied into code goes stale unseen.
GPU_KERNEL_FLOOR_S = 2.5e-6

# custom calls XLA's TPU compiler leaves in place that run no kernel: the pieces of a sliced copy
# reassembled by a bitcast (memory-space assignment's ConcatBitcast), a buffer allocation, a marker
_NO_WORK_CALL = re.compile(r'custom_call_target="(ConcatBitcast|AllocateBuffer|AssumeGatherIndicesInBound)"')

_LIBRARY_CALL = re.compile(r'custom_call_target="__(cublas|cudnn)')
_IN_PLACE = ("dynamic-update-slice", "scatter")


class _L2:
    """The L2 rule of `hbm_traffic` for one computation (an estimate: the compiled program says
    nothing of what the cache keeps): which results may live in L2 (kernel
    results of at most half of it that are not loop state, outputs or in-place updates), when each
    was written (bytes streamed so far, counted all-in-HBM), and what a kernel's reads and its own
    result cost with that."""

    def __init__(self, body, comps, l2_bytes):
        self.half, self.pos, self.src, self.written, self.pending = l2_bytes // 2, 0.0, {}, {}, {}
        self.kept = set()  # what reaches the computation's root: outputs and loop state, always in HBM
        todo = [body[-1]["name"]] if body else []
        self.by_name = by_name = {i["name"]: i for i in body}
        while todo:
            n = todo.pop()
            if n in self.kept or n not in by_name:
                continue
            self.kept.add(n)
            if by_name[n]["op"] in ("tuple", "bitcast", "get-tuple-element"):
                todo += by_name[n]["args"]
        self.comps = comps

    def alias(self, ins):
        """bitcast / get-tuple-element of a result read the result itself."""
        if ins["op"] in ("bitcast", "get-tuple-element") and ins["args"]:
            self.src[ins["name"]] = self.src.get(ins["args"][0], ins["args"][0])

    def _in_place(self, ins):
        if ins["op"] in _IN_PLACE or "output_to_operand_aliasing" in ins["line"]:
            return True
        callee = re.search(r"calls=%?([\w.\-]+)", ins["line"]) if ins["op"] == "fusion" else None
        body = self.comps.get(callee.group(1), []) if callee else []
        roots = body[-1:] if body and body[-1]["op"] != "tuple" else [
            i for i in body if i["name"] in body[-1]["args"]] if body else []
        return any(r["op"] in _IN_PLACE for r in roots)

    def nested(self, ins, moved) -> float:
        """A while loop, conditional, call or asynchronous copy over `ins`'s operands: they enter it
        in HBM (the writes still pending are charged, returned), and the `moved` bytes it streams
        turn the L2 over."""
        late, todo, seen = 0.0, list(ins["args"]), set()
        while todo:
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            late += self.pending.pop(self.src.get(a, a), 0)
            if self.by_name.get(a, {}).get("op") == "tuple":
                todo += self.by_name[a]["args"]
        self.pos += moved
        return late

    def kernel(self, ins, operands, res, streamed):
        """(operands as charged, late writes to charge, result as charged) for one kernel that moves
        `streamed` bytes counted all in HBM (how far the L2 turns over)."""
        operands, late = list(operands), 0.0
        for j, a in enumerate(ins["args"]):
            a = self.src.get(a, a)
            if a not in self.written:
                continue
            if self.pos - self.written[a] <= self.half:
                operands[j] = 0  # still in L2
            else:
                late += self.pending.pop(a, 0)  # evicted before this read: it was written to HBM
        name = ins["name"]
        if 0 < res <= self.half and name not in self.kept and not ins["op"].endswith(("-start", "-done")) \
                and not self._in_place(ins):
            self.written[name], self.pending[name], res = self.pos + streamed, res, 0
        self.pos += streamed
        return operands, late, res


def hbm_traffic(hlo_text: str, top: int = 0, loop: bool = False, l2_bytes: int = 0, bytes_per_s: float = 0.0,
                kernel_floor_s: float = 0.0) -> dict:
    """HBM bytes and kernels of a compiled (optimised, fused, memory-space-assigned) HLO module:
    each top-level instruction reads its operands and writes its result, as a fused kernel does,
    counting only arrays in HBM (what the compiler placed in on-chip memory is free; the async
    copies and slices that bring it there are charged as HBM reads). Inside a fusion, a parameter
    only sliced is charged the slices, one gathered the rows gathered; an in-place update
    (dynamic-update-slice or scatter into a parameter) is charged the update, not the buffer. While
    bodies count their trip count (`known_trip_count`, else an `i < N` condition: counted_trips;
    once, with a warning, if neither), a conditional its largest branch, kernels included (so
    kernels are those executed, not those in the text; asynchronous copies, DMAs that overlap the
    kernels, are not kernels). `loop`: one trip of the costliest while loop of the entry
    computation instead (a decode loop's step or round, without what runs once around it).

    `l2_bytes` (a GPU's L2 cache; an estimate, by this rule): a kernel's result of at most half of
    it that is read again before another half of the L2 has streamed through (by the all-in-HBM
    count of what the kernels, loops and copies in between move) is read from L2 (split-K partial
    sums, a layer's attention scores at a short context); its write is charged only if some read
    comes later than that (to the reading kernel), else it is taken to stay in L2 until its buffer
    is reused. Program inputs, loop state (what enters or leaves a loop, conditional or call),
    in-place updates (caches) and outputs are always charged.

    Returns {"bytes", "kernels"}, and with `top` > 0 "top": the `top` costliest instructions as
    (bytes, name, source op_name). With `bytes_per_s`, also "seconds": each kernel's bytes at that
    bandwidth but never less than `kernel_floor_s` (what a small kernel costs whatever it moves:
    launch, ramp-up, tail; an estimate, GPU_KERNEL_FLOOR_S), plus the asynchronous copies' bytes at
    that bandwidth, executed kernels and trips counted as above."""
    comps = computations(hlo_text)
    costs = []
    at_bw = (lambda nb: nb / bytes_per_s) if bytes_per_s else (lambda nb: 0.0)  # seconds to move nb bytes

    def charge(ins, nbytes):
        if top:
            src = re.search(r'op_name="([^"]*)"', ins["line"])
            costs.append((nbytes, ins["name"], src.group(1) if src else ins["op"]))
        return nbytes

    def through(comp, name):
        """The uses of `name` inside `comp`, looking through bitcasts and bitcast-only fusions."""
        uses = []
        for ins in comps.get(comp, []):
            if name not in ins["args"]:
                continue
            callee = re.search(r"calls=%?([\w.\-]+)", ins["line"])
            trivial = ins["op"] == "bitcast" or (ins["op"] == "fusion" and callee and all(
                i["op"] in ("parameter", "bitcast") for i in comps.get(callee.group(1), [])))
            uses += through(comp, ins["name"]) if trivial else [(ins, ins["args"].index(name))]
        return uses

    def param_read(callee, k, full):
        """What a fusion reads of its operand k (`full` bytes in HBM): the slices or rows it takes,
        through nested fusions; nothing of a buffer it only updates in place; else all of it."""
        body = comps.get(callee, [])
        p = next((i for i in body if i["op"] == "parameter"
                  and int(re.search(r"parameter\((\d+)\)", i["line"]).group(1)) == k), None)
        uses = through(callee, p["name"]) if p is not None else []
        if not full or not uses:
            return full
        total = 0
        for u, j in uses:
            if u["op"] in ("slice", "dynamic-slice", "gather") and j == 0:
                total += array_bytes(u["shape"])
            elif u["op"] in ("dynamic-update-slice", "scatter") and j == 0:
                continue  # (updated in place: only the update is written)
            elif u["op"] == "fusion":  # a nested fusion: what it reads of that parameter
                total += param_read(re.search(r"calls=%?([\w.\-]+)", u["line"]).group(1), j, full)
            else:
                return full
        return min(full, total)

    def fusion_bytes(callee, operands, result_hbm):
        body = comps.get(callee, [])
        sizes = {i["name"]: array_bytes(i["shape"]) for i in body}
        total = sum(param_read(callee, k, b) for k, b in enumerate(operands))  # (0 when it is on chip)
        if not body or not result_hbm:
            return total + result_hbm
        roots = [body[-1]]
        if roots[0]["op"] == "tuple":
            roots = [i for a in roots[0]["args"] for i in body if i["name"] == a]
        written = sum(sizes.get(r["args"][1], 0) if r["op"] == "dynamic-update-slice"
                      else sizes.get(r["args"][-1], 0) if r["op"] == "scatter" else sizes[r["name"]]
                      for r in roots)
        return total + min(written, result_hbm)

    def walk(comp):
        hbm, full, start_src, nbytes, kernels, secs = {}, {}, {}, 0.0, 0, 0.0
        body = comps.get(comp, [])
        by_name = {i["name"]: i for i in body}
        l2 = _L2(body, comps, l2_bytes) if l2_bytes else None
        for ins in body:
            name, op, line, args = ins["name"], ins["op"], ins["line"], ins["args"]
            shape = ins["shape"]
            if op == "custom-call" and shape.startswith("(") and _LIBRARY_CALL.search(line):
                shape = re.sub(r",\s*[su]8\[\d+\]\{0\}\)$", ")", shape)  # its workspace is not traffic
            res = hbm[name] = hbm_bytes(shape)
            full[name] = array_bytes(ins["shape"])
            if l2 is not None:
                l2.alias(ins)
            if op.endswith("-start"):  # charged when done: the source read (if in HBM), the result written
                start_src[name] = hbm.get(args[0], 0) if args else 0
                continue
            if op.endswith("-done"):
                moved = array_bytes(ins["shape"])
                moved = min(start_src.get(args[0], moved), moved) + res
                nbytes += charge(ins, moved)
                secs += at_bw(moved)
                if l2 is not None:  # (its source was read in HBM)
                    extra = l2.nested(by_name.get(args[0], ins) if args else ins, moved)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue  # (an asynchronous copy: a DMA beside the kernels, not one of them)
            if op in FREE or (op == "custom-call" and _NO_WORK_CALL.search(line)):
                continue
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                b, k, t = walk(re.search(r"body=%?([\w.\-]+)", line).group(1))
                n = int(n.group(1)) if n else counted_trips(comps, body, ins)
                nbytes, kernels, secs = nbytes + b * n, kernels + k * n, secs + t * n
                if l2 is not None:  # its state enters in HBM; what it streams turns the L2 over
                    extra = l2.nested(ins, b * n)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            if op == "conditional":
                names = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [x.strip().lstrip("%") for x in names.group(1).split(",")] if names else [
                    re.search(key + r"=%?([\w.\-]+)", line).group(1) for key in ("true_computation", "false_computation")]
                branch = [walk(c) for c in names]
                nbytes, kernels = nbytes + max(c[0] for c in branch), kernels + max(c[1] for c in branch)
                secs += max(c[2] for c in branch)
                if l2 is not None:
                    extra = l2.nested(ins, max(c[0] for c in branch))
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            if op == "call":
                b, k, t = walk(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
                nbytes, kernels, secs = nbytes + b, kernels + k, secs + t
                if l2 is not None:
                    extra = l2.nested(ins, b)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            kernels += 1

            def moves(operands, res):
                if op == "fusion":
                    return fusion_bytes(re.search(r"calls=%?([\w.\-]+)", line).group(1), operands, res)
                if op in ("slice", "dynamic-slice"):
                    return min(operands[0], full[name]) + res
                if op == "dynamic-update-slice":
                    return operands[1] + min(res, full.get(args[1], 0))
                return sum(operands) + res
            operands = [hbm.get(a, 0) for a in args]
            late = 0.0  # writes of earlier results read too late to find them in L2, charged here
            if l2 is not None:  # (the L2 turns over by what the kernel moves counted all in HBM)
                streamed = moves(operands, res)
                operands, late, res = l2.kernel(ins, operands, res, streamed)
            moved = moves(operands, res) + late
            nbytes += charge(ins, moved)
            secs += max(at_bw(moved), kernel_floor_s) if bytes_per_s else 0.0
        return nbytes, kernels, secs
    if loop:
        bodies = [re.search(r"body=%?([\w.\-]+)", i["line"]).group(1) for i in comps.get("ENTRY", [])
                  if i["op"] == "while"]
        if not bodies:
            raise ValueError("no while loop in the entry computation")
        best = None
        for c in bodies:
            costs.clear()
            r = walk(c)
            if best is None or r[0] > best[0][0]:
                best = (r, list(costs))
        (b, k, t), costs[:] = best
    else:
        b, k, t = walk("ENTRY")
    out = {"bytes": b, "kernels": k}
    if bytes_per_s:
        out["seconds"] = t
    if top:  # (a while body's instructions are listed once, at one trip's cost)
        out["top"] = sorted(costs, reverse=True)[:top]
    return out
