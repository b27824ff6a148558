"""Data-parallel and FSDP training of the NanoGPT example, with the same step code.

    python -m experiments.nanogpt.train --config fp8 --mesh dp         # data parallel
    python -m experiments.nanogpt.train --config fp8 --mesh fsdp       # params + state sharded
    python -m experiments.nanogpt.train --config fp8 --mesh dp:e5m2    # FP8 gradient all-reduce

The mesh is one axis, "data", over every available device (`scalify.distributed.make_mesh`);
the batch is split along it. Modes (`--mesh`):

- ``none``: one device, `step.make_train_step` as is.
- ``dp``: the step of `step.make_train_step`, jitted with shardings (GSPMD): parameters
  and optimizer state replicated, batch sharded; XLA inserts the gradient all-reduces, in
  the gradients' dtype.
- ``fsdp``: the same step with the parameters and the optimizer state sharded over "data"
  too (`scalify.distributed.fsdp_shardings`: each array along its largest divisible
  dimension, scales replicated): XLA all-gathers the parameters where they are used and
  reduce-scatters the gradients (ZeRO-3).
- ``dp:WIRE[:SCALING[:METHOD]]`` (WIRE one of e5m2, e4m3, float16, bfloat16, float32;
  SCALING one of auto, pre, post; METHOD psum or all_to_all): explicit data parallelism. The update function of `step.make_update_fn`
  runs per device in a `jax.shard_map` (local batch, replicated state), and its gradients
  are averaged by `scalify.distributed.scaled_pmean` with that wire format, so that they
  cross the wire in 8 or 16 bits with a shared scale; the loss is averaged in the same call
  (in float32; on a bfloat16 wire the vectors' gradients too, `_vectors_own_dtype`). On a
  bfloat16 or float32 wire ("auto") the values themselves travel, with no scale agreement
  first, so the step has the plain step's collectives, overlapped with
  the backward pass: ``dp:bfloat16`` is the data-parallel mode for the scalify recipes
  (every dynamic scale is then taken on the device's own batch; XLA's ``dp`` reduces those
  statistics over the devices, one scalar all-reduce each). METHOD
  "psum" is one all-reduce in the wire format (a backend may widen 8-bit all-reduces: XLA's
  CPU backend sums FP8 in float16); "all_to_all" moves raw 8/16-bit words (one all-to-all,
  float32 sum, one all-gather, the scales and the loss inside the same buffers), the same
  bytes as a ring all-reduce in the wire format. The whole
  shard_map is scalified (scalify's shard_map rule), like the single-device step.
- ``fsdp:WIRE`` (WIRE the format the recipe's matmuls cast kernels to: e4m3 for the fp8
  recipes, float16 for fp16, bfloat16 for bf16): ``fsdp`` whose sharded parameters are
  kernels are all-gathered in WIRE (`scalify.distributed.gather_as`; 1 byte per weight for
  FP8, the scale is a replicated float32 scalar). That cast is the one the matmuls apply
  anyway, so the step computes the same values as ``fsdp``; embeddings and the gradient
  reductions are XLA's, as in ``fsdp``.
- ``fsdp:WIRE:GRAD_WIRE`` (e.g. ``fsdp:e4m3:bfloat16``): the state sharded and the kernels
  gathered in WIRE as in ``fsdp:WIRE``, then the forward and backward passes per device in
  a `jax.shard_map`, as in ``dp:GRAD_WIRE``: every dynamic scale is taken on the device's
  own batch (XLA's ``fsdp`` reduces each of those statistics over the devices, one scalar
  all-reduce each). Each gradient is averaged in GRAD_WIRE straight to its parameter's
  shard (`scalify.distributed.scaled_psum_scatter`: one reduce-scatter per sharded
  parameter, half the ring bytes of an all-reduce, as ``fsdp``'s), the replicated ones
  and the loss by `scaled_pmean`. The optimizer updates the sharded state.

In every mode the jitted step has the signature of `step.make_train_step`'s:
``step(state, tokens, targets) -> (state, loss)``; `shard_state` places a state (the
output shardings equal the input ones, so the step never recompiles), and batches of host
arrays are split by the jit's input shardings. The global batch must be a multiple of the
number of devices.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import socket
import subprocess
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scalify import distributed as D
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf

from experiments.nanogpt import step as S
from experiments.nanogpt.configs import resolve_dtype

__all__ = ["ParallelConfig", "WIRES", "parse_mesh", "make_mesh", "state_shardings", "weight_grads_in",
           "place_batch", "launch", "user_args", "init_process", "shard_state", "make_parallel_train_step", "setup", "describe"]

WIRES = {
    "e5m2": jnp.float8_e5m2,
    "e4m3": jnp.float8_e4m3fn,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
}
AXIS = D.DATA_AXIS


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the step is spread over devices (see the module docstring)."""

    mode: str = "none"  # "none", "dp" or "fsdp"
    wire: str | None = None  # explicit scaled gradient all-reduce in this format (dp only)
    scaling: str = "auto"  # pre / post / auto (scalify.distributed.scaled_pmean)
    method: str = "psum"  # psum / all_to_all (scalify.distributed.scaled_pmean)
    grad_wire: str | None = None  # fsdp: gradients averaged per device in this format

    @property
    def name(self) -> str:
        if self.wire is None:
            return self.mode
        name = f"{self.mode}:{self.wire}"
        if self.grad_wire is not None:
            return f"{name}:{self.grad_wire}"
        if self.method != "psum":
            return f"{name}:{self.scaling}:{self.method}"
        return name if self.scaling == "auto" else f"{name}:{self.scaling}"


def parse_mesh(spec: str) -> ParallelConfig:
    """'none' | 'dp' | 'fsdp' | 'dp:WIRE[:SCALING[:METHOD]]' | 'fsdp:WIRE[:GRAD_WIRE]' ->
    ParallelConfig."""
    parts = [p.strip() for p in str(spec).split(":")]
    mode = parts[0] or "none"
    if mode not in ("none", "dp", "fsdp"):
        raise ValueError(f"--mesh: unknown mode {mode!r}; use none, dp, fsdp, dp:WIRE[:SCALING[:METHOD]] "
                         "or fsdp:WIRE[:GRAD_WIRE].")
    wire = parts[1] if len(parts) > 1 else None
    scaling = parts[2] if len(parts) > 2 else "auto"
    method = parts[3] if len(parts) > 3 else "psum"
    if wire is not None:
        if mode == "none":
            raise ValueError(f"--mesh {spec}: a wire format needs 'dp' or 'fsdp'.")
        if mode == "fsdp" and len(parts) > 3:
            raise ValueError(f"--mesh {spec}: 'fsdp:WIRE[:GRAD_WIRE]' takes no scaling or method (the "
                             "weights are gathered in WIRE; the gradients are averaged in GRAD_WIRE).")
        if wire not in WIRES:
            raise ValueError(f"--mesh {spec}: unknown wire format {wire!r}; choose from {', '.join(WIRES)}.")
        if mode == "fsdp" and len(parts) == 3:
            if parts[2] not in WIRES:
                raise ValueError(f"--mesh {spec}: unknown gradient wire format {parts[2]!r}; choose from "
                                 f"{', '.join(WIRES)}.")
            return ParallelConfig(mode, wire, "auto", "psum", parts[2])
        if scaling not in D.SCALINGS:
            raise ValueError(f"--mesh {spec}: unknown scaling {scaling!r}; choose from {', '.join(D.SCALINGS)}.")
        if method not in D.METHODS:
            raise ValueError(f"--mesh {spec}: unknown method {method!r}; choose from {', '.join(D.METHODS)}.")
    if len(parts) > 4:
        raise ValueError(f"--mesh {spec}: expected MODE[:WIRE[:SCALING[:METHOD]]].")
    return ParallelConfig(mode, wire, scaling, method)


def make_mesh(num_devices: int | None = None):
    """A 1-D mesh "data" over the first `num_devices` devices (default: all)."""
    return D.make_mesh(num_devices, (AXIS,))


def state_shardings(state: S.TrainState, mesh, mode: str) -> Any:
    """NamedShardings of a TrainState: replicated for "dp"/"none", FSDP-sharded for "fsdp"
    (parameters and optimizer state; the step counter and small arrays replicated)."""
    if mode == "fsdp":
        return D.fsdp_shardings(state, mesh, AXIS)
    return D.replicated_shardings(state, mesh)


def place_batch(batch, mesh):
    """A host batch (tokens, targets) as global arrays split over "data" when several
    processes run the step (each keeps its rows); unchanged with one process (the jitted
    step splits host arrays itself)."""
    if jax.process_count() == 1:
        return batch
    return D.place(batch, (D.batch_sharding(mesh, AXIS),) * len(batch))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch(module: str, argv: list[str], processes: int) -> list[int]:
    """Run ``python -m module *argv --process-id i --coordinator HOST:PORT`` for i < `processes`
    on this host and wait for them; returns their exit codes. Process i gets GPU i (of
    ``CUDA_VISIBLE_DEVICES`` where set) on a machine with NVIDIA GPUs, and the simulated CPU
    devices of ``XLA_FLAGS`` are dropped: one device per process. The processes find each
    other through `init_process`."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpus.split(",") if gpus else (None if shutil.which("nvidia-smi") is None else
                                         [str(i) for i in range(processes)])
    if gpus is not None and len(gpus) < processes:
        raise SystemExit(f"--processes {processes}: only {len(gpus)} GPUs visible.")
    coordinator = f"localhost:{_free_port()}"
    procs = []
    for i in range(processes):
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                    if not f.startswith("--xla_force_host_platform_device_count"))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        cmd = [sys.executable, "-m", module, *argv, "--process-id", str(i), "--coordinator", coordinator]
        procs.append(subprocess.Popen(cmd, env=env))
    return [p.wait() for p in procs]


def user_args(argv: list[str]) -> list[str]:
    """`argv` without the ``--process-id I --coordinator HOST:PORT`` that `launch` adds."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--process-id", "--coordinator"):
            skip = True
        else:
            out.append(a)
    return out


def init_process(coordinator: str, processes: int, process_id: int) -> None:
    """This process's part of a `launch`: `jax.distributed.initialize` (gloo collectives on
    CPU), one local device. Call it before anything starts JAX's backend."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    if jax.local_device_count() != 1:
        raise SystemExit(f"process {process_id}: {jax.local_device_count()} local devices; --processes runs "
                         "one device per process: give each process one GPU with CUDA_VISIBLE_DEVICES "
                         "(`launch` does where it finds nvidia-smi).")


def shard_state(state: S.TrainState, mesh, mode: str) -> S.TrainState:
    """`state` placed on the mesh with `state_shardings` (`scalify.distributed.place`)."""
    return D.place(state, state_shardings(state, mesh, mode))


def _check_batch(mesh, batch_size: int | None):
    n = mesh.size
    if batch_size is not None and batch_size % n:
        raise ValueError(f"The batch size {batch_size} is not a multiple of the {n} devices of the mesh; "
                         f"use --batch-size {max(n, batch_size // n * n)} or fewer devices.")


def _fsdp_gather_hook(recipe, mesh, par: ParallelConfig, state: S.TrainState) -> Callable:
    """`params -> params` with every sharded kernel passed through
    `scalify.distributed.gather_as` to a replicated layout in WIRE (the cast the model's
    matmuls make; checked here). Embeddings are left to XLA: it looks tokens up in the
    sharded table (an all-to-all of the rows) and reduces their gradient to the shards,
    which moves less than gathering the table and all-reducing its gradient."""
    if recipe.flax_fp8:
        raise ValueError(f"--mesh {par.name}: the Flax fp8 baseline quantises kernels with its own "
                         "delayed scales; use --mesh fsdp.")
    wire = jnp.dtype(WIRES[par.wire])
    kernel = resolve_dtype(recipe.matmul_kernel) or resolve_dtype(recipe.dtype)
    if wire != kernel:
        raise ValueError(f"--mesh {par.name}: recipe {recipe.name!r} casts kernels to {kernel.name}; "
                         f"gathering them in {wire.name} would change the step. Use "
                         f"--mesh fsdp:{_wire_name(kernel)}.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(state.params, is_leaf=is_scaled_leaf)
    specs = jax.tree_util.tree_leaves(D.fsdp_specs(state.params, mesh, AXIS),
                                      is_leaf=lambda x: isinstance(x, (P, ScaledArray)))
    formats = []
    for (path, _), spec in zip(flat, specs):
        data_spec = spec.data if isinstance(spec, ScaledArray) else spec
        if any(e is not None for e in data_spec) and "kernel" in jax.tree_util.keystr(path):
            formats.append((wire, NamedSharding(mesh, data_spec)))
        else:  # replicated, or an embedding: XLA's plan (a sharded lookup moves less)
            formats.append(None)
    replicated = NamedSharding(mesh, P())

    def hook(params):
        leaves = treedef.flatten_up_to(params)
        return treedef.unflatten([p if f is None else D.gather_as(p, f[0], replicated, source=f[1])
                                  for p, f in zip(leaves, formats)])

    return hook


def weight_grads_in(gpt, wire):
    """`gpt` whose FP8 linear layers (`scalify.nn.Dense` with FP8 inputs and output
    gradients: an FP8 weight-gradient GEMM) write their kernel gradients in `wire` when it
    is bfloat16 (`Dense.weight_grad_dtype`): those gradients are rounded to bfloat16 on the
    wire anyway, so their values are unchanged, and the GEMM writes them, its scales
    applied inside it, instead of a float32 output that a pass scales and casts before the
    collective. Other wires and layers: `gpt` as is."""
    from scalify.nn import Dense
    from scalify.quant.formats import is_fp8

    dense = gpt.dense_cls
    fp8_backward = (isinstance(dense, functools.partial) and dense.func is Dense
                    and all(dense.keywords.get(r) is not None and is_fp8(dense.keywords[r])
                            for r in ("input_dtype", "grad_dtype")))
    if jnp.dtype(wire) != jnp.bfloat16 or not fp8_backward:
        return gpt
    return dataclasses.replace(gpt, dense_cls=functools.partial(dense, weight_grad_dtype=jnp.bfloat16))


def _fsdp_explicit_step(recipe, gpt, tx, mesh, par: ParallelConfig, state: S.TrainState, seed: int):
    """``fsdp:WIRE:GRAD_WIRE``: the state stays sharded as in ``fsdp`` and the kernels are
    gathered in WIRE as in ``fsdp:WIRE`` (XLA's all-gathers, before the step), but the
    forward and backward passes run per device in a `jax.shard_map` on the device's batch,
    as in ``dp:GRAD_WIRE``: every dynamic scale is taken on the device's own data (no
    collective). Each gradient leaves the shard_map as its parameter's shard, averaged in
    GRAD_WIRE by `_reduce_to_shards`, and the optimizer updates the sharded state."""
    gather = _fsdp_gather_hook(recipe, mesh, par, state)
    specs = _param_data_specs(state.params, mesh)
    reduce = functools.partial(_reduce_to_shards, specs=specs, wire=WIRES[par.grad_wire])
    grads_of = S.make_grad_fn(recipe, weight_grads_in(gpt, WIRES[par.grad_wire]), grad_hook=reduce)
    apply = S.make_apply_fn(recipe, tx, seed)
    local = jax.shard_map(grads_of, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                          out_specs=(specs, P(), P()), check_vma=False)

    def update(st, tokens, targets):
        grads, extra_grads, loss = local(gather(st.params), st.extra, tokens, targets)
        return apply(st, grads, extra_grads), loss

    return S.train_step_of(recipe, update)


def _param_data_specs(params, mesh):
    """The FSDP PartitionSpec of each parameter's data (`fsdp_specs`; a ScaledArray's data
    spec): the specs of the parameters' values as a scalified function sees them."""
    specs = D.fsdp_specs(params, mesh, AXIS)
    return jax.tree_util.tree_map(lambda s: s.data if isinstance(s, ScaledArray) else s, specs,
                                  is_leaf=lambda s: isinstance(s, (P, ScaledArray)))


def _reduce_to_shards(grads_and_loss, *, specs, wire):
    """(grads, loss) of one device -> (each gradient averaged over the devices and cut to
    its parameter's shard, the loss averaged). A gradient whose parameter is sharded on
    dimension d is reduce-scattered along d (`scaled_psum_scatter`: (N-1)/N of its bytes
    per device in `wire` against 2(N-1)/N for an all-reduce); the replicated ones and the
    float32 loss go through one `scaled_pmean`. On a bfloat16 or float32 wire each leaf's
    collective depends on that leaf alone (no common-scale agreement), so XLA can start
    it as soon as the backward pass has produced the gradient."""
    grads, loss = grads_and_loss
    treedef = jax.tree_util.tree_structure(specs, is_leaf=lambda s: isinstance(s, P))
    leaves, spec_leaves = treedef.flatten_up_to(grads), jax.tree_util.tree_leaves(
        specs, is_leaf=lambda s: isinstance(s, P))
    out, whole = [], []
    for i, (g, spec) in enumerate(zip(leaves, spec_leaves)):
        dims = [d for d, e in enumerate(spec) if e is not None]
        if dims:
            out.append(D.scaled_psum_scatter(g, AXIS, scatter_dimension=dims[0], mean=True, wire_dtype=wire))
        else:
            out.append(None)
            whole.append(i)
    averaged, loss = D.scaled_pmean(([leaves[i] for i in whole], loss), AXIS, wire_dtype=wire,
                                    own_dtype_below=2)
    for i, g in zip(whole, averaged):
        out[i] = g
    return treedef.unflatten(out), loss


def _vectors_own_dtype(tree, **kwargs):
    """`scaled_pmean` of the gradients and the loss where the leaves smaller than every
    matrix (biases, LayerNorm parameters, the loss) are averaged in their own dtype, float32,
    as plain bf16 data parallelism averages its float32 parameters' gradients (0.1% more
    bytes on `paper`). XLA:GPU combines the all-reduces of one dtype into buckets, one
    concatenation each: the kernels' gradients fill the bfloat16 buckets, the small ones a
    float32 bucket with the loss, as in the plain step."""
    sizes = [math.prod(np.shape(v)) for v in jax.tree_util.tree_leaves(tree, is_leaf=is_scaled_leaf)
             if np.ndim(v) >= 2]
    return D.scaled_pmean(tree, own_dtype_below=min(sizes, default=2), **kwargs)


def _wire_name(dtype) -> str:
    return next(k for k, v in WIRES.items() if jnp.dtype(v) == jnp.dtype(dtype))


def make_parallel_train_step(recipe, gpt, tx, mesh, par: ParallelConfig | str, state: S.TrainState, *,
                             seed: int = 0, donate: bool = False,
                             packing: S.ScalePacking | None = None) -> Callable:
    """The jitted ``step(state, tokens, targets) -> (state, loss)`` of `par` on `mesh`.

    `state` is an example state (its structure gives the shardings). For ``none`` this is
    `step.make_train_step`. With `packing` (a `step.ScalePacking` of `state`) the step takes
    and returns ``packing.pack(state)``: the state's float32 scalars in one replicated vector
    instead of one buffer each on every device (`pack_state` places a state so).
    """
    par = parse_mesh(par) if isinstance(par, str) else par
    donate_argnums = (0,) if donate else ()
    if par.mode == "none":
        if packing is None:
            return S.make_train_step(recipe, gpt, tx, seed=seed, jit=True, donate=donate)
        return jax.jit(packing.step(S.make_train_step(recipe, gpt, tx, seed=seed, jit=False)),
                       donate_argnums=donate_argnums, compiler_options=S.compiler_options(recipe))
    state_sh = state_shardings(state, mesh, par.mode)
    batch_sh = D.batch_sharding(mesh, AXIS)
    replicated = NamedSharding(mesh, P())
    if par.wire is None:
        step = S.make_train_step(recipe, gpt, tx, seed=seed, jit=False)
    elif par.mode == "fsdp" and par.grad_wire is None:
        hook = _fsdp_gather_hook(recipe, mesh, par, state)
        step = S.make_train_step(recipe, gpt, tx, seed=seed, jit=False, param_hook=hook)
    elif par.mode == "fsdp":
        step = _fsdp_explicit_step(recipe, gpt, tx, mesh, par, state, seed)
    else:
        if recipe.flax_fp8:
            raise ValueError(f"--mesh {par.name}: the Flax fp8 baseline keeps per-device FP8 statistics; "
                             "use --mesh dp (XLA's all-reduce).")
        # The loss (a scalar) is averaged in float32 with the gradients, in the same call;
        # on a bfloat16 wire the vectors' gradients travel in float32 too (`_vectors_own_dtype`).
        hook = functools.partial(_vectors_own_dtype if par.wire == "bfloat16" and par.method == "psum"
                                 else functools.partial(D.scaled_pmean, own_dtype_below=2),
                                 axis_name=AXIS, wire_dtype=WIRES[par.wire], scaling=par.scaling,
                                 method=par.method)
        local = S.make_update_fn(recipe, weight_grads_in(gpt, WIRES[par.wire]), tx, seed, grad_hook=hook)

        sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                                out_specs=(P(), P()), check_vma=False)
        step = S.train_step_of(recipe, sharded)

    if packing is not None:
        step, state_sh = packing.step(step), _packed_shardings(packing, state_sh, replicated)
    return jax.jit(step, in_shardings=(state_sh, batch_sh, batch_sh),
                   out_shardings=(state_sh, replicated), donate_argnums=donate_argnums,
                   compiler_options=S.compiler_options(recipe))


def _packed_shardings(packing: S.ScalePacking, state_sh, replicated):
    """The shardings of ``packing.pack(state)`` from those of `state`: the packed scalars
    replicated, every other leaf as it was."""
    leaves = packing.treedef.flatten_up_to(state_sh)
    return [x for x, m in zip(leaves, packing.mask) if not m], replicated


def pack_state(packing: S.ScalePacking, state: S.TrainState, mesh, mode: str):
    """`state` placed on `mesh` as `shard_state` does, then packed by `packing` (the vector of
    scalars replicated): the argument of a step made with the same `packing`."""
    if mesh is None:
        return packing.pack(state)
    sh = _packed_shardings(packing, state_shardings(state, mesh, mode), NamedSharding(mesh, P()))
    return D.place(packing.pack(state), sh)


def setup(recipe, gpt, tx, state: S.TrainState, mesh_spec: str, *, seed: int = 0, donate: bool = False,
          batch_size: int | None = None, num_devices: int | None = None):
    """For `train.py`: (step, sharded state, mesh) of `--mesh mesh_spec` (None mesh for
    "none": the single-device step and the state unchanged)."""
    par = parse_mesh(mesh_spec)
    if par.mode == "none":
        return S.make_train_step(recipe, gpt, tx, seed=seed, jit=True, donate=donate), state, None
    mesh = make_mesh(num_devices)
    _check_batch(mesh, batch_size)
    step = make_parallel_train_step(recipe, gpt, tx, mesh, par, state, seed=seed, donate=donate)
    return step, shard_state(state, mesh, par.mode), mesh


def describe(mesh, par: ParallelConfig | str) -> str:
    """One line for logs: mode and devices."""
    par = parse_mesh(par) if isinstance(par, str) else par
    if mesh is None:
        return "1 device"
    kinds = sorted({d.device_kind for d in mesh.devices.flat})
    return f"{par.name} over {mesh.size} devices ({', '.join(kinds)})"
