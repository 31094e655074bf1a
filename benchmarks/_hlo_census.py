"""An op census of a compiled program's optimised HLO (``compiled.as_text()``), loops counted
by their trip counts (``step_census.py``).

XLA's own ``cost_analysis()`` counts a ``while`` body once, whatever its trip count, so a
scanned layer stack or a loss walked in chunks (``lax.map``) reads as one layer or one chunk.
Here every computation is weighted by how often it runs: a ``while`` body by its
``known_trip_count`` or, where the compiler names none (the TPU's), by its condition's
``counter < N`` (a loop with neither counts once and is reported in ``unknown_trips``),
a fused computation by its fusion's weight. What is counted:

- ``kernels``: the instructions that run as kernels (those of the entry computation, loop
  bodies and called computations; plumbing such as ``parameter``, ``tuple``,
  ``get-tuple-element``, ``bitcast`` and ``constant`` left out), by opcode, a fusion by
  ``fusion:<kind>``;
- ``bytes``: each kernel's operands and result in HBM (what it reads and writes, as XLA's
  ``bytes accessed`` estimates it; on a TPU an array the compiler keeps in on-chip memory,
  ``S(1)`` in its layout, moves none, and an asynchronous copy or slice counts once, at its
  ``-done``), by opcode like ``kernels``;
- ``ops``: every instruction inside kernels and fusions alike, by opcode;
- ``dot_flops``: ``2 x result elements x contracted elements`` of every ``dot`` (a
  ``convolution``: its kernel's elements that are not output features, a window over a
  dilated input by the taps that meet it), by operand and result dtypes
  (``bf16,bf16->f32``), and by what JAX named the product (``dot_flops_by_name``);
- ``converts``: elements converted, by ``from->to`` dtype;
- ``dots``: each distinct product (``lhs x rhs -> result`` shapes and dtypes) and how often
  it runs, and ``top``: the kernels that move the most bytes with what JAX named them
  (``op_name``), so a difference can be traced to its source.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass, field

#: instructions that move or name data without running a kernel of their own
PLUMBING = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "opt-barrier",
}  # fmt: skip
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "f8e4m3fn": 1, "f8e5m2": 1, "token": 0,
}  # fmt: skip

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) (\(.*\))? ?-> .*\{$|^(ENTRY )?%?([\w.\-]+) \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_CALLS = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")


@dataclass
class Instruction:
    name: str
    shape: str  # the result type as printed (an array, or a tuple of them)
    opcode: str
    rest: str  # operands and attributes as printed

    @property
    def operands(self) -> list[str]:
        depth, out, current = 0, [], ""
        for ch in self.rest:
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                if depth == 0:
                    break
                depth -= 1
            if ch == "," and depth == 0:
                out.append(current)
                current = ""
            else:
                current += ch
        out.append(current)
        return [o.strip().split(" ")[-1].lstrip("%") for o in out if o.strip()]


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction] = field(default_factory=list)

    def shapes(self) -> dict[str, str]:
        return {i.name: i.shape for i in self.instructions}


def start_backend(script: str, backend: str) -> bool:
    """JAX started on ``backend`` (the CPU's kept to itself with ``JAX_PLATFORMS``): False,
    with a line on stderr naming ``script``, where JAX runs elsewhere."""
    import os
    import sys

    if backend == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if jax.default_backend() == backend:
        return True
    print(f"{script}: --backend {backend}, but JAX runs on {jax.default_backend()}",
          file=sys.stderr)  # fmt: skip
    return False


def compiles_for_chip(script: str, backend: str) -> bool:
    """A census's ``--for-chip``: this CPU host set up to compile for a TPU v5e with libtpu
    (``tpu_compile.compile_only``); False, with a line on stderr, where it cannot."""
    import sys

    if backend != "cpu":
        print(f"{script}: --for-chip compiles on a CPU host (--backend cpu)", file=sys.stderr)
        return False
    import tpu_compile

    return tpu_compile.compile_only(script)


def parse(text: str) -> dict[str, Computation]:
    """The module's computations by name, each with its instructions in order."""
    computations, current = {}, None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _COMPUTATION.match(line)
            if m:
                name = m.group(2) or m.group(5)
                current = computations[name] = Computation(name, bool(m.group(1) or m.group(4)))
            continue
        m = _INSTRUCTION.match(line)
        if current is not None and m:
            current.instructions.append(Instruction(m.group(2), m.group(3), m.group(4), m.group(5)))
    return computations


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in a printed type (one, or a tuple's)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(shape.split("{")[0] if "(" not in shape else shape)
        if dtype in DTYPE_BYTES
    ]


def nbytes(shape: str) -> float:
    return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in arrays(shape))


def hbm_bytes(shape: str) -> float:
    """The bytes of the arrays in a printed type that live in the device's main memory: an
    array whose layout names a memory space (``S(1)``, a TPU's on-chip vector memory, where
    the chip's compiler prefetches operands; ``S(2)`` and above, its scalar memory) moves
    none (a CPU program names none)."""
    return sum(
        DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims, layout in _ARRAY_LAYOUT.findall(shape)
        if dtype in DTYPE_BYTES and not _ON_CHIP.search(layout)
    )


def _weights(computations: dict[str, Computation]) -> tuple[dict, set, list]:
    """How many times each computation runs per call of the entry, the fused computations
    (whose instructions are not kernels) and the loops without a known trip count."""
    weight = collections.Counter()
    fused, unknown = set(), []
    entry = next(c for c in computations.values() if c.entry)

    def visit(comp: Computation, times: float) -> None:
        weight[comp.name] += times
        for ins in comp.instructions:
            trips = 1
            if ins.opcode == "while":
                found = _TRIPS.search(ins.rest)
                trips = int(found.group(1)) if found else _counted(ins, computations)
                if trips is None:
                    trips = 1
                    unknown.append(ins.name)
            callees = [(kind, name) for kind, name in _CALLS.findall(ins.rest)]
            for branches in _BRANCHES.findall(ins.rest):
                callees += [("branch", b.strip().lstrip("%")) for b in branches.split(",")]
            for kind, name in callees:
                if kind == "to_apply" or name not in computations:
                    continue  # a reduction's scalar combiner runs inside its kernel
                if kind == "calls" and ins.opcode == "fusion":
                    fused.add(name)
                n = trips + 1 if kind == "condition" else trips
                visit(computations[name], times * n)

    visit(entry, 1)
    return weight, fused, unknown


def _counted(loop: Instruction, computations: dict[str, Computation]) -> int | None:
    """The trip count of a ``while`` that names none (the TPU compiler's programs): its
    condition's ``counter < N`` on the loop's first element against a constant, the form JAX
    writes for a scan or a ``fori_loop`` from 0; None where the condition is another."""
    found = re.search(r"\bcondition=%?([\w.\-]+)", loop.rest)
    condition = computations.get(found.group(1)) if found else None
    if condition is None or not condition.instructions:
        return None
    named = {i.name: i for i in condition.instructions}
    root = condition.instructions[-1]
    operands = root.operands[:2]
    if root.opcode == "fusion":  # the compare wrapped in a fusion of its own (newer XLA:CPU)
        found = re.search(r"calls=%?([\w.\-]+)", root.rest)
        inner = computations.get(found.group(1)) if found else None
        if inner is None or not inner.instructions:
            return None
        params = {i.name: int(re.match(r"(\d+)", i.rest).group(1))
                  for i in inner.instructions if i.opcode == "parameter"}  # fmt: skip
        compare = inner.instructions[-1]
        if any(
            params.get(o, len(root.operands)) >= len(root.operands) for o in compare.operands[:2]
        ):
            return None
        operands = [root.operands[params[o]] for o in compare.operands[:2]]
        root = compare
    if root.opcode != "compare" or "direction=LT" not in root.rest or len(operands) < 2:
        return None
    counter, bound = (named.get(o) for o in operands)
    if counter is None or bound is None or bound.opcode != "constant":
        return None
    if counter.opcode != "get-tuple-element" or not re.search(r"\bindex=0\b", counter.rest):
        return None
    value = re.match(r"\s*(-?\d+)\)", bound.rest)
    return int(value.group(1)) if value else None


def _dot_flops(ins: Instruction, shapes: dict[str, str]) -> tuple[float, str]:
    """``(flops, "lhs,rhs->result" dtypes)`` of a dot or convolution."""
    operands = [arrays(shapes.get(o, "")) for o in ins.operands[:2]]
    result = arrays(ins.shape)
    if not result or not all(operands):
        return 0.0, "?"
    (lhs_t, lhs_d), (rhs_t, rhs_d) = operands[0][0], operands[1][0]
    out_t, out_d = result[0]
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        contracted = math.prod(lhs_d[d] for d in dims)
    else:  # convolution: the kernel's elements that are not output features
        m = re.search(r"dim_labels=\w+_(\w+)->", ins.rest)
        labels = m.group(1) if m else ""
        contracted = math.prod(n for n, lab in zip(rhs_d, labels, strict=False) if lab != "o")
        # a window over an input dilated by d (zeros between its elements) meets a real
        # element once in d taps: the chip's grouped gradient is such a convolution
        window = re.search(r"window=\{([^}]*)\}", ins.rest)
        sizes = re.search(r"\bsize=([\dx]+)", window.group(1)) if window else None
        dilated = re.search(r"\blhs_dilate=([\dx]+)", window.group(1)) if window else None
        if sizes and dilated:
            for size, d in zip(sizes.group(1).split("x"), dilated.group(1).split("x"), strict=True):
                contracted = contracted * math.ceil(int(size) / int(d)) / int(size)
    return 2.0 * math.prod(out_d) * contracted, f"{lhs_t},{rhs_t}->{out_t}"


def _moved(ins: Instruction, shapes: dict[str, str], computations: dict) -> float:
    """Bytes a kernel reads and writes: its operands and result, except that an operand a
    fusion only slices (``dynamic-slice``: a layer of a stacked array) counts by the slices,
    and a fusion whose result updates an operand in place (``dynamic-update-slice`` at its
    root or in its root tuple: a layer's gradient or saved product into a stacked one) by
    the update, as XLA's cost analysis counts them."""
    operands = [hbm_bytes(shapes.get(o, "")) for o in ins.operands]
    written = hbm_bytes(ins.shape)
    found = re.search(r"calls=%?([\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
    fused = computations.get(found.group(1)) if found else None
    if fused is None:
        return written + sum(operands)
    inner = fused.shapes()
    params = {i.name: int(re.match(r"(\d+)", i.rest).group(1))
              for i in fused.instructions if i.opcode == "parameter"}  # fmt: skip
    users = collections.defaultdict(list)
    for i in fused.instructions:
        for position, name in enumerate(i.operands):
            users[name].append((i, position))
    root = fused.instructions[-1] if fused.instructions else None
    named = {i.name: i for i in fused.instructions}
    # the results a fusion writes: its root, or each element of a root tuple (a scan's step
    # writes a layer into each of several stacked arrays at once)
    results = [named.get(o) for o in root.operands] if root and root.opcode == "tuple" else [root]
    in_place = {r.operands[0]: r for r in results if r and r.opcode == "dynamic-update-slice"}
    if root is not None and root.opcode == "tuple" and in_place:
        written = sum(hbm_bytes(inner.get(r.operands[1], "")) if r.name in
                      {u.name for u in in_place.values()} else hbm_bytes(r.shape)
                      for r in results if r is not None)  # fmt: skip
    # a loop fusion that ends in a static slice (an expert's matrix out of a stacked one)
    # computes, and so reads, only the sliced elements of operands the slice's size
    slices = {math.prod(d) : math.prod(arrays(i.shape)[0][1])
              for i in fused.instructions if i.opcode == "slice"
              for _, d in arrays(inner.get(i.operands[0], ""))[:1]}  # fmt: skip
    for name, index in params.items():
        uses = users.get(name, [])
        if index >= len(operands) or not uses or not operands[index]:
            continue  # unread, or held on-chip: no HBM bytes however it is read
        sliced = _sliced_bytes(uses, computations)
        if sliced is not None:
            operands[index] = sliced
        elif name in in_place and uses == [(in_place[name], 0)]:
            operands[index] = 0.0  # updated in place: only the update is written
            if root.opcode == "dynamic-update-slice":
                written = hbm_bytes(inner.get(root.operands[1], ""))
        elif "kLoop" in ins.rest and slices:
            for dtype, dims in arrays(inner.get(name, ""))[:1]:
                if math.prod(dims) in slices:
                    operands[index] = DTYPE_BYTES[dtype] * slices[math.prod(dims)]
    return written + sum(operands)


def _started_from(ins: Instruction, named: dict) -> list[Instruction]:
    """What an asynchronous ``-done`` moves: its ``-start``'s operands (none for any other
    instruction)."""
    start = named.get(ins.operands[0]) if ins.opcode.endswith("-done") and ins.operands else None
    return [named[o] for o in start.operands if o in named] if start else []


def _transferred(ins: Instruction, named: dict) -> float:
    """The HBM bytes of an asynchronous copy or slice (``copy-start`` ... ``copy-done``: the
    chip's compiler moving an operand to or from its on-chip memory beside other kernels),
    counted once, at its ``-done``: its result (the destination, ``X``) read from its source
    and written to it, each side only where it is HBM; a ``-start`` moves nothing of its
    own (its printed tuple holds source, destination and a context)."""
    if ins.opcode.endswith("-start"):
        return 0.0
    source_in_hbm = any(hbm_bytes(source.shape) for source in _started_from(ins, named))
    return (nbytes(ins.shape) if source_in_hbm else 0.0) + hbm_bytes(ins.shape)


def _named_by(ins: Instruction, named: dict) -> str:
    """The attributes that name a kernel: its own, or for an asynchronous copy's ``-done``
    (which JAX names nothing) those of what its ``-start`` moves, so the bytes go to the
    array's source (``top``)."""
    sources = [] if _OP_NAME.search(ins.rest) else _started_from(ins, named)
    return sources[0].rest if sources else ins.rest


def _sliced_bytes(uses: list, computations: dict) -> float | None:
    """The bytes read of an operand whose every use slices it (``dynamic-slice``: a layer of
    a stacked array), directly or through a fusion nested in the kernel that only slices
    it: the slices' bytes; None where a use reads it whole."""
    total = 0.0
    for ins, position in uses:
        if ins.opcode == "dynamic-slice" and position == 0:
            total += nbytes(ins.shape)
            continue
        found = re.search(r"calls=%?([\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
        nested = computations.get(found.group(1)) if found else None
        if nested is None:
            return None
        param = next((i.name for i in nested.instructions if i.opcode == "parameter"
                      and re.match(rf"{position}\)", i.rest)), None)  # fmt: skip
        inner = [(i, at) for i in nested.instructions
                 for at, name in enumerate(i.operands) if name == param]  # fmt: skip
        read = _sliced_bytes(inner, computations) if param and inner else None
        if read is None:
            return None
        total += read
    return total


def census(text: str, top: int = 12) -> dict:
    """The census of one optimised HLO module (see the module docstring)."""
    computations = parse(text)
    weight, fused, unknown = _weights(computations)
    kernels, kernel_bytes, ops = collections.Counter(), collections.Counter(), collections.Counter()
    dot_flops, converts, dots = collections.Counter(), collections.Counter(), collections.Counter()
    heavy, flops_by_name = collections.Counter(), collections.Counter()
    for comp in computations.values():
        times = weight.get(comp.name, 0)
        if not times:
            continue
        shapes = comp.shapes()
        named = {i.name: i for i in comp.instructions}
        for ins in comp.instructions:
            if ins.opcode == "parameter" and comp.name in fused:
                continue
            ops[ins.opcode] += times
            if ins.opcode in ("dot", "convolution"):
                flops, kinds = _dot_flops(ins, shapes)
                dot_flops[kinds] += flops * times
                named = _OP_NAME.search(ins.rest)
                flops_by_name[named.group(1) if named else ""] += flops * times
                sig = " x ".join(shapes.get(o, "?").split("{")[0] for o in ins.operands[:2])
                dots[f"{sig} -> {ins.shape.split('{')[0]}"] += times
            if ins.opcode == "convert":
                src = (arrays(shapes.get(ins.operands[0], "")) or [("?", ())])[0][0]
                dst, dims = arrays(ins.shape)[0]
                converts[f"{src}->{dst}"] += math.prod(dims) * times
            if comp.name in fused or ins.opcode in PLUMBING or ins.opcode == "while":
                continue
            kind = ins.opcode
            if kind == "fusion":
                found = re.search(r"kind=(k\w+)", ins.rest)
                kind = f"fusion:{found.group(1) if found else '?'}"
            moved = (_transferred(ins, named) if kind.endswith(("-start", "-done"))
                     else _moved(ins, shapes, computations))  # fmt: skip
            kernels[kind] += times
            kernel_bytes[kind] += moved * times
            name = _OP_NAME.search(_named_by(ins, named))
            label = f"{kind} {ins.shape.split('{')[0][:60]} {name.group(1) if name else ''}"
            heavy[label[:200]] += moved * times
    return {
        "dot_flops": dict(dot_flops),
        "dot_flops_by_name": dict(flops_by_name),
        "kernels": dict(kernels),
        "bytes": dict(kernel_bytes),
        "ops": dict(ops),
        "converts": dict(converts),
        "dots": dict(dots),
        "top": heavy.most_common(top),
        "unknown_trips": unknown,
    }


def stablehlo_ops(text: str) -> dict:
    """``{op: count}`` of a lowered program's StableHLO text (each written op once, a
    function called many times counted once), with ``exponential@HIGHEST`` for the
    exponentials that ask for their highest accuracy."""
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"= (?:\"?)([a-z_]+\.[a-z_]+)", line) or re.search(
            r"^\s*(stablehlo\.[a-z_]+|func\.[a-z_]+)", line
        )
        if not m:
            continue
        op = m.group(1)
        if op == "stablehlo.exponential" and "HIGHEST" in line:
            op += "@HIGHEST"
        counts[op] += 1
    return dict(counts)
