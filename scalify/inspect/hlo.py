"""Reading compiled XLA programs: what a scalified (or any) jitted function became.

All functions take the optimized HLO text of a compiled program
(`jax.jit(f).lower(*args).compile().as_text()`) or the `jax.stages.Compiled` itself:

- `count_fp8_gemms`: the FP8 GEMMs: cuBLASLt FP8 custom calls and GEMM fusions (XLA's
  Triton GEMMs) whose dot reads FP8 operands (did the FP8 matmuls fuse?);
- `hlo_instruction_count`: the number of instructions (a size measure of the program,
  e.g. of the scale arithmetic scalify adds);
- `hlo_op_kinds`: a category per instruction (GEMM, reduce, scalar, elementwise, copy),
  to group the kernels of a profile;
- `hlo_op_sources`: the part of the model and the pass each instruction comes from
  (`"backward lm_head"`), from the JAX op names XLA keeps as metadata;
- `collective_bytes`: the collectives and the bytes they move;
- `peak_temporaries`: the temporaries live at the program's peak, and what wrote them.
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np

__all__ = [
    "FP8_GEMM_TARGET",
    "count_fp8_gemms",
    "runs_fp8_gemms",
    "hlo_instruction_count",
    "xla_memory",
    "hlo_op_kinds",
    "hlo_op_sources",
    "source_label",
    "CollectiveOp",
    "collective_bytes",
    "PeakTemporaries",
    "peak_temporaries",
]

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S", re.M)


def _text(compiled_or_text) -> str:
    return compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()


_FP8_TYPE = re.compile(r"^\s*f8e\w*\[")
_COMPUTATION = re.compile(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _instructions(hlo_text: str):
    """(computation or None, is_root, name, text after `=`) of each instruction line of an
    HLO module text, in order."""
    comp = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        # A header has no `=` before its body's brace but in `/*index=5*/` comments, which
        # a long tuple type of the ENTRY computation carries.
        if m and "=" not in re.sub(r"/\*.*?\*/", "", line.split("{")[0]):
            comp = m.group(1)
            continue
        d = _INSTRUCTION.match(line)
        if d:
            yield comp, bool(d.group(1)), d.group(2), d.group(3)


def _fp8_dot_computations(hlo_text: str) -> set[str]:
    """Names of the computations holding a `dot` whose two operands are FP8 (XLA keeps the
    FP8 operands of a GEMM it emits with Triton inside the GEMM fusion's computation)."""
    found, types = set(), {}
    for comp, _, name, rest in _instructions(hlo_text):
        if not comp:
            continue
        types[name] = bool(_FP8_TYPE.match(rest))
        dot = re.search(r"\sdot\(%?([\w.\-]+),\s*%?([\w.\-]+)\)", rest)
        if dot and types.get(dot.group(1)) and types.get(dot.group(2)):
            found.add(comp)
    return found


def _fp8_gemm_fusions(hlo_text: str) -> set[str]:
    """Names of the fusion instructions that call an FP8-dot computation."""
    comps = _fp8_dot_computations(hlo_text)
    names = set()
    for _, _, name, rest in _instructions(hlo_text):
        if " fusion(" in rest:
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            if called and called.group(1) in comps:
                names.add(name)
    return names


def runs_fp8_gemms(device=None) -> bool:
    """Whether `device` (default: the first JAX device) has FP8 GEMMs: an NVIDIA GPU of
    compute capability 8.9 (Ada) or newer (Hopper: 9.0). Elsewhere `count_fp8_gemms` is 0:
    XLA computes FP8 dots in a wider type."""
    dev = device if device is not None else jax.devices()[0]
    return dev.platform == "gpu" and float(getattr(dev, "compute_capability", "0")) >= 8.9


def count_fp8_gemms(compiled_or_text) -> int:
    """Number of FP8 GEMMs in a compiled program: cuBLASLt FP8 custom calls plus GEMM
    fusions whose dot takes two FP8 operands (XLA picks Triton over cuBLASLt for some
    shapes, e.g. small ones); 0 on CPU."""
    text = _text(compiled_or_text)
    return text.count(f'custom_call_target="{FP8_GEMM_TARGET}"') + len(_fp8_gemm_fusions(text))


def hlo_instruction_count(compiled_or_text) -> int:
    """Number of instructions (`name = ...` lines) in all computations of a compiled
    program, fused computations included."""
    return len(_INSTRUCTION_RE.findall(_text(compiled_or_text)))


XLA_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                     "temp_size_in_bytes")


def xla_memory(compiled) -> dict:
    """XLA's memory analysis of a compiled program: its fields (`XLA_MEMORY_FIELDS`, in
    bytes) and `bytes`, the program's memory on a device: arguments + outputs - aliased
    (donated) + temporaries. A backend without the analysis gives `{"unavailable": why}`."""
    try:
        ma = compiled.memory_analysis()
        fields = {k: int(getattr(ma, k)) for k in XLA_MEMORY_FIELDS}
    except Exception as e:  # noqa: BLE001 - backends differ in what they raise
        return {"unavailable": str(e)}
    return {**fields, "bytes": (fields["argument_size_in_bytes"] + fields["output_size_in_bytes"]
                                - fields["alias_size_in_bytes"] + fields["temp_size_in_bytes"])}


def hlo_op_kinds(hlo_text: str) -> dict[str, str]:
    """Category of each instruction of an optimized HLO module text: instruction name ->
    "gemm-fp8" (cuBLASLt FP8 GEMM custom calls and GEMM fusions of two FP8 operands), "gemm"
    (other cuBLAS/cuBLASLt calls and Triton GEMM fusions), "reduce" (fusions whose
    computation has a `reduce` and whose every output is smaller than their largest operand:
    a pass of its own that reads a tensor and writes less), "scalar" (other fusions with at
    most 64 output elements: scale arithmetic), "elementwise" (other fusions, including one
    that writes an output as large as its largest operand and reduces on the side, such as an
    optimizer update that also takes the new parameters' max) or "copy" (copies,
    transposes). Other instructions are left out."""
    reduce_comps, elements = set(), {}
    for comp, _, name, rest in _instructions(hlo_text):
        if comp and re.match(r"\S+\s+reduce\(", rest):
            reduce_comps.add(comp)
        elements[name] = _largest_output(rest)
    kinds, fp8_fusions = {}, _fp8_gemm_fusions(hlo_text)
    for _, _, name, rest in _instructions(hlo_text):
        if FP8_GEMM_TARGET in rest or name in fp8_fusions:
            kinds[name] = "gemm-fp8"
        elif "custom-call(" in rest and re.search(r"cublas|gemm|matmul", rest):
            kinds[name] = "gemm"
        elif " fusion(" in rest and ("__triton_gemm" in rest or name.startswith("gemm_fusion")):
            kinds[name] = "gemm"  # a GEMM emitted by XLA's Triton backend
        elif " fusion(" in rest:
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            operands = re.findall(r"%?([\w.\-]+)", rest.split(" fusion(", 1)[1].split(")", 1)[0])
            largest_in = max((elements.get(o, 0) for o in operands), default=0)
            if called and called.group(1) in reduce_comps and _largest_output(rest) < largest_in:
                kinds[name] = "reduce"
            else:
                kinds[name] = "scalar" if _output_elements(rest) <= 64 else "elementwise"
        elif re.search(r"\s(copy|transpose|copy-start|copy-done)\(", rest):
            kinds[name] = "copy"
    return kinds


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def source_label(op_name: str) -> str:
    """A short label of where a JAX op name comes from: the pass ("forward" under `jvp`,
    "backward" under `transpose`, else "other", e.g. the optimizer) and the module path
    (flax's names; `layers_3` becomes `layers_*`), without inner jit names and the
    primitive. `"jit(step)/transpose(jvp(Llama))/layers_2/feed_forward/w1/mul"` ->
    `"backward layers_*/feed_forward/w1"`."""
    parts = op_name.split("/")
    phase = "other"
    if any(p.startswith("transpose(") for p in parts):
        phase = "backward"
    elif any(p.startswith("jvp(") for p in parts):
        phase = "forward"
    path = [re.sub(r"_\d+$", "_*", p) for p in parts[1:-1] if "(" not in p]
    return f"{phase} {'/'.join(path) or '-'}"


def hlo_op_sources(compiled_or_text) -> dict[str, str]:
    """`source_label` of each instruction of a compiled program: instruction name -> label.
    A fusion without an op name of its own takes that of its computation's root, or of the
    last named instruction in it (a tuple root). Instructions without any are left out."""
    instructions = list(_instructions(_text(compiled_or_text)))
    comp_name, named, root = {}, {}, {}
    for comp, is_root, name, rest in instructions:
        op = _OP_NAME.search(rest)
        if op:
            named[name] = op.group(1)
            if comp:
                comp_name[comp] = op.group(1)
                if is_root:
                    root[comp] = op.group(1)
    out = {}
    for _, _, name, rest in instructions:
        op_name = named.get(name)
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if " fusion(" in rest and called:
            op_name = op_name or root.get(called.group(1)) or comp_name.get(called.group(1))
        if op_name:
            out[name] = source_label(op_name)
    return out


def _output_sizes(rest: str) -> list[int]:
    """Elements of each array an HLO instruction writes (its text after ``=``: the result
    type, up to the opcode)."""
    head = re.split(r"\s[a-z][\w\-]*\(", rest, maxsplit=1)[0]
    return [math.prod(int(d) for d in filter(None, dims.split(","))) for dims in re.findall(r"\w+\[([\d,]*)\]", head)]


def _largest_output(rest: str) -> int:
    """Elements of the largest array an HLO instruction writes (1 for none)."""
    return max(_output_sizes(rest), default=1)


def _output_elements(rest: str) -> int:
    """Number of output elements of an HLO instruction (its text after ``=``)."""
    return sum(_output_sizes(rest))


# ---------------------------------------------------------------------------------------
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
}
_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_OP_RE = re.compile(
    r"=\s*(?P<result>.+?)\s(?P<op>all-reduce-start|all-reduce|reduce-scatter-start|reduce-scatter|all-gather-start|"
    r"all-gather|all-to-all|collective-permute-start|collective-permute)\((?P<args>[^)]*)\)"
    r"(?P<attrs>.*)$"
)
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def _dtype_bytes(name: str) -> float | None:
    if name in _BYTES:
        return _BYTES[name]
    if name.startswith("f8") or name.startswith("f4") or name.startswith("f6"):
        return 1 if name.startswith("f8") else 0.5 if name.startswith("f4") else 0.75
    return None


def _shapes(text: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _SHAPE_RE.findall(text):
        if _dtype_bytes(dtype) is None:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((dtype, n))
    return out


def _first_group(text: str) -> str:
    """The first parenthesised group of `text` (which starts with "("), nesting included."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[: i + 1]
    return text


def _group_size(attrs: str, default: int | None) -> int | None:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len([g for g in m.group(1).split(",") if g])
    if re.search(r"replica_groups=\{\}", attrs):  # empty: every device of the program
        return default
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)  # mesh[...] {axes}
    if m:
        sizes = {k.strip().strip("'\""): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        axes = [a.strip().strip("'\"") for a in m.group(2).split(",") if a.strip()]
        return int(np.prod([sizes.get(a, 1) for a in axes])) if axes else 1
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)  # iota form [groups,size]<=[N]
    if m:
        return int(m.group(1).split(",")[-1])
    if "source_target_pairs" in attrs:
        return 2
    return None


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program.

    `operand_bytes`: bytes of its operands (the payload each device contributes);
    `wire_bytes`: bytes each device sends with the usual ring algorithms, for a group of
    G devices: all-reduce 2(G-1)/G x operand, reduce-scatter (G-1)/G x operand, all-gather
    (G-1) x operand, all-to-all (G-1)/G x operand, collective-permute the operand.
    """

    op: str
    dtypes: tuple
    elements: int
    operand_bytes: int
    group_size: int | None
    wire_bytes: float
    bytes_by_dtype: tuple = ()  # ((dtype, operand bytes), ...), summing to operand_bytes


def collective_bytes(compiled_or_text, *, min_elements: int = 0) -> dict:
    """Collectives of a compiled XLA program and the bytes they move.

    Args:
      compiled_or_text: a `jax.stages.Compiled` (e.g. `jax.jit(f).lower(...).compile()`)
        or its HLO text (`compiled.as_text()`).
      min_elements: ignore collectives with fewer operand elements (e.g. 2 to leave out the
        scalar reductions of scales, losses and norms).
    Returns:
      {"ops": [CollectiveOp, ...], "operand_bytes": total, "wire_bytes": total,
       "by_op": {op: operand bytes}, "count_by_op": {op: number}, "wire_by_op": {op: wire
       bytes}, "by_dtype": {dtype: operand bytes}, "count": n}.
      Asynchronous pairs are counted once (their `-start`); operations XLA wraps in an
      `async-start` are counted where they appear in the wrapped computation.
    """
    text = _text(compiled_or_text)
    m = re.search(r"num_partitions=(\d+)", text)
    n_default = int(m.group(1)) if m else None
    m = re.search(r"replica_count=(\d+)", text)
    if m and int(m.group(1)) > 1:
        n_default = int(m.group(1)) * (n_default or 1)
    ops = []
    for line in text.splitlines():
        m = _OP_RE.search(line)
        if m is None:
            continue
        op = m.group("op").replace("-start", "")
        g = _group_size(m.group("attrs"), n_default)
        gg = g or 1
        shapes = _shapes(m.group("args"))
        ratio = 1.0
        if not shapes:  # operands printed without shapes: from the result's
            res = _shapes(m.group("result"))
            start = m.group("op").endswith("-start")
            if start and op == "all-gather":  # ((operands), (outputs))
                shapes = res[: max(len(res) // 2, 1)]
            elif start and op in ("all-reduce", "reduce-scatter") and m.group("result").lstrip().startswith("(("):
                # XLA:GPU's async all-reduce and reduce-scatter: ((operands), outputs)
                shapes = _shapes(_first_group(m.group("result").lstrip()[1:]))
            elif start and op == "collective-permute":  # (operand, output, contexts)
                shapes = res[:1]
            else:
                shapes = res
                if op == "all-gather":
                    ratio = 1 / gg
                elif op == "reduce-scatter":
                    ratio = gg
        elements = int(sum(n for _, n in shapes) * ratio)
        if elements < min_elements:
            continue
        per_dtype: dict[str, float] = {}
        for d, n in shapes:
            per_dtype[d] = per_dtype.get(d, 0.0) + n * _dtype_bytes(d) * ratio
        nbytes = int(sum(per_dtype.values()))
        factor = {"all-reduce": 2 * (gg - 1) / gg, "reduce-scatter": (gg - 1) / gg,
                  "all-gather": gg - 1, "all-to-all": (gg - 1) / gg,
                  "collective-permute": 1.0}[op]
        ops.append(CollectiveOp(op, tuple(sorted(per_dtype)), elements, nbytes, g, nbytes * factor,
                                tuple(sorted((d, int(b)) for d, b in per_dtype.items()))))
    by_op: dict[str, int] = {}
    count_by_op: dict[str, int] = {}
    wire_by_op: dict[str, float] = {}
    by_dtype: dict[str, int] = {}
    for o in ops:
        by_op[o.op] = by_op.get(o.op, 0) + o.operand_bytes
        count_by_op[o.op] = count_by_op.get(o.op, 0) + 1
        wire_by_op[o.op] = wire_by_op.get(o.op, 0.0) + o.wire_bytes
        for d, b in o.bytes_by_dtype:  # a combined collective: each dtype's own bytes
            by_dtype[d] = by_dtype.get(d, 0) + b
    return {
        "ops": ops,
        "count": len(ops),
        "operand_bytes": int(sum(o.operand_bytes for o in ops)),
        "wire_bytes": float(sum(o.wire_bytes for o in ops)),
        "by_op": by_op,
        "count_by_op": count_by_op,
        "wire_by_op": wire_by_op,
        "by_dtype": by_dtype,
    }


# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PeakTemporaries:
    """The temporaries of a compiled program at its peak, replayed from XLA's schedule.

    `bytes`: their sum; `at`: the instruction at which it is reached; `live`: what holds
    them, as ``(source, type, count, bytes)`` rows, largest first (`source`: `source_label`
    of the instruction that wrote the buffer; `type`: its result type, e.g.
    ``"f32[14336,4096]"``).
    """

    bytes: int
    at: str
    live: tuple


_NO_TEMP = ("parameter", "constant")  # arguments and constants have allocations of their own
_VIEWS = ("get-tuple-element", "tuple", "bitcast")  # names for buffers written elsewhere
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)


def _entry_instructions(hlo_text: str):
    """(name, is_root, result type, opcode, operand names, attributes) of each instruction
    of the ENTRY computation (`_instructions`), in the order printed: XLA's schedule for a
    compiled module."""
    entry = _ENTRY.search(hlo_text)
    for comp, is_root, name, rest in _instructions(hlo_text):
        if entry is None or comp != entry.group(1):
            continue
        rtype = _first_group(rest) if rest.startswith("(") else rest.split(" ", 1)[0]
        after = rest[len(rtype):].lstrip()
        op = re.match(r"([a-z][\w\-]*)\(", after)
        if not op:
            continue
        args = _first_group(after[op.end() - 1:])
        operands = re.findall(r"%([\w.\-]+)", args)
        yield name, is_root, rtype, op.group(1), operands, after[op.end() - 1 + len(args):]


def _type_bytes(rtype: str) -> int:
    return int(sum(n * _dtype_bytes(dt) for dt, n in _shapes(rtype)))


def _tuple_elements(rtype: str) -> list[str]:
    """The top-level element types of a tuple type ``(a, b, ...)``; [rtype] for an array."""
    if not rtype.startswith("("):
        return [rtype]
    parts, depth, cur = [], 0, ""
    for ch in rtype[1:-1]:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [re.sub(r"/\*.*?\*/", "", x).strip() for x in parts if x.strip()]


def _buffers(rows):
    """(reads, size, type) of an entry computation's buffers, a buffer being (writer,
    element of its result): `reads` maps each instruction to the buffers its result is (a
    view's: its operands'); `size` and `type` (without layout) of each buffer."""
    views, size, kind = {}, {}, {}

    def reads(name):
        return set().union(*views.get(name, [set()]))

    for name, _, rtype, op, operands, attrs in rows:
        if op == "get-tuple-element" and operands:
            src, index = views.get(operands[0], [set()]), re.search(r"index=(\d+)", attrs)
            k = int(index.group(1)) if index else len(src)
            views[name] = [src[k]] if k < len(src) else [reads(operands[0])]
        elif op == "tuple":
            views[name] = [reads(o) for o in operands]
        elif op == "bitcast" and operands:
            views[name] = views.get(operands[0], [set()])
        elif op in _NO_TEMP:
            views[name] = [set()]
        else:
            views[name] = []
            for k, t in enumerate(_tuple_elements(rtype)):
                size[(name, k)], kind[(name, k)] = _type_bytes(t), re.sub(r"\{[^}]*\}", "", t)
                views[name].append({(name, k)})
    return {name: set().union(*v) for name, v in views.items()}, size, kind


def _written(reads, name) -> list:
    """The buffers instruction `name` writes (its own among those its result is), in order."""
    return sorted(b for b in reads.get(name, ()) if b[0] == name)


def _aliased_outputs(hlo_text: str, rows, reads) -> set:
    """The buffers of the program's outputs that XLA writes into a donated argument's
    buffer (the module's `input_output_alias`: output tuple index -> parameter)."""
    header = hlo_text.split("\n", 1)[0]  # the HloModule line
    indices = [k.split(",")[0] for k in re.findall(r"\{([\d,]*)\}:\s*\(\d+,", header)]
    root = next((r for r in rows if r[1]), None)
    if not indices or root is None:
        return set()
    name, _, _, op, operands, _ = root
    if op != "tuple" or "" in indices:
        return set(reads.get(name, ()))
    return set().union(*(reads.get(operands[int(k)], set()) for k in indices if int(k) < len(operands)))


def _allocations(rows, reads, size, aliased=frozenset()):
    """(group of each buffer, last reader of each group, groups that are outputs): a buffer
    written over the first operand buffer of its size that dies at its writer joins that
    buffer's group, one allocation (XLA writes in place where it can); an output in
    `aliased` is written into its donated argument's buffer and joins only a group that
    starts with a `copy` (XLA's copy of that argument), not a value the step computed."""
    pos = {name: i for i, (name, *_rest) in enumerate(rows)}
    last = {b: pos[b[0]] for b in size}
    outputs = set()
    for name, is_root, _, op, operands, _ in rows:
        if is_root:
            outputs = reads[name]
        if op in _VIEWS:  # a view reads nothing: its readers read its buffers
            continue
        for b in set().union(*(reads.get(o, set()) for o in operands)):
            last[b] = max(last[b], pos[name])
    group = {b: b for b in size}
    copies = {name for name, _, _, op, _, _ in rows if op == "copy"}
    for i, (name, _, _, _, operands, _) in enumerate(rows):
        dying = {}  # size -> the operand buffers of that size whose last reader this is, in order
        for b in dict.fromkeys(b for o in operands for b in sorted(reads.get(o, ()))):
            if last[b] == i and b[0] != name:
                dying.setdefault(size[b], []).append(b)
        for b in _written(reads, name):
            if b in aliased:  # over XLA's copy of its argument, not over a computed value
                dying[size[b]] = [d for d in dying.get(size[b], []) if group[d][0] in copies]
            if dying.get(size[b]):
                group[b] = group[dying[size[b]].pop(0)]
    end = {}
    for b, g in group.items():
        end[g] = max(end.get(g, -1), last[b])
    return group, end, {group[b] for b in outputs}


def peak_temporaries(compiled_or_text, *, min_bytes: int = 0) -> PeakTemporaries:
    """Replay of the ENTRY computation's schedule: every instruction that writes buffers
    (one per element of a tuple result; not a parameter, constant or view: bitcast,
    get-tuple-element, tuple) holds each from itself to its last reader (through views: a
    `get-tuple-element` reads nothing, its readers read its one element);
    buffers the ROOT reaches are the program's outputs, not temporaries. A buffer takes the
    place of an operand buffer of its size that dies at it (XLA writes in place where it
    can), and a chain of such buffers ending in an output is the output's allocation; an
    output aliased to a donated argument (`input_output_alias`) is written into the
    argument's buffer, so it takes the place only of XLA's copy of an argument, and a value
    the step computed (a gradient the update reads) stays a temporary. The
    peak is the largest sum of live temporaries: an estimate of XLA's
    `temp_size_in_bytes`, which packs the same buffers in one allocation. Nested
    computations (a while loop's body) are not entered. Rows of `live` under `min_bytes`
    are left out."""
    text = _text(compiled_or_text)
    rows = list(_entry_instructions(text))
    reads, size, kind = _buffers(rows)
    group, end, outputs = _allocations(rows, reads, size, _aliased_outputs(text, rows, reads))
    ends = {}
    for g, i in end.items():
        ends.setdefault(i, []).append(g)
    holder = {}  # group -> its member written last so far
    live, total, peak, at, peak_set = set(), 0, 0, "", set()
    for i, (name, *_rest) in enumerate(rows):
        for b in _written(reads, name):
            g = group[b]
            if g in outputs:
                continue
            if g not in live:
                live.add(g)
                total += size[b]
            holder[g] = b
        if total > peak:
            peak, at, peak_set = total, name, {holder[g] for g in live}
        for g in ends.get(i, ()):
            if g in live:
                live.discard(g)
                total -= size[g]
    sources, rows_by = hlo_op_sources(text), {}
    for b in peak_set:
        key = (sources.get(b[0], "other -"), kind[b])
        count, nbytes = rows_by.get(key, (0, 0))
        rows_by[key] = (count + 1, nbytes + size[b])
    table = sorted(((s, t, c, n) for (s, t), (c, n) in rows_by.items() if n >= min_bytes), key=lambda r: -r[3])
    return PeakTemporaries(peak, at, tuple(table))
