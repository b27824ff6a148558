"""The scalify transform: trace a function to a jaxpr, then re-interpret it over ScaledArrays.

The loop is the one of JAX's "Writing custom Jaxpr interpreters" guide: an environment from
variables to values and one dispatch per equation.

- An equation with no ScaledArray input is bound as is (so the graph is unchanged where no
  scaled arrays flow).
- Otherwise the primitive's scale rule is called (looked up in `scalify.core.registry`,
  where the modules of `scalify/rules/` and `scalify/ops/` register them when `import
  scalify` imports them; this module imports no rule). Before a
  plain rule is called, its unscaled float inputs are promoted to ScaledArray by
  `scalify.core.scale_flow.promote` (plain arrays: scale 1; constants: exact power-of-two
  split; 0/inf/nan: the largest input scale). The interpreter tracks which values are
  "broadcast scalars" (a literal or 0-d value, possibly broadcast/converted/reshaped) so
  that promotion can treat them as constants.
  Call-like primitives (jit, scan, while, cond, remat, custom_jvp/vjp) have "call rules" that
  receive the raw inputs and their broadcast-scalar metadata, and recurse with
  `interpret_jaxpr`.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.extend import source_info_util

from scalify import frameworks
from scalify.core.config import get_config
from scalify.core import observe
from scalify.core.errors import ScaledTypeError, UnsupportedPrimitiveError
from scalify.core.folds import fold_zero_scatter_adds
from scalify.core.lax_utils import bind_as_is
from scalify.core.lru import LRUCache
from scalify.core.registry import lookup
from scalify.core.scale_flow import (
    as_plain_scaled, cut_scale, is_cut, memo_get, promote_inputs, scale_cache, seed_scale_barrier,
    unchecked_scaled,
)
from scalify.core.guards import rebalance_inputs
from scalify.core.scaled_array import ScaledArray, check_pow2_scale, is_float, is_scaled_leaf
from scalify.core.value_bounds import bound_of, value_bounds
from scalify.core.spmd import agree_scales, manual_axes
from scalify.outer_ad import call_with_value_vjp, under_reverse_ad

__all__ = ["scalify", "interpret_jaxpr"]


# ---------------------------------------------------------------------------------------
# Value metadata and promotion
# ---------------------------------------------------------------------------------------
# Primitives through which "this value is a broadcast of a scalar" survives.
_SCALAR_PRESERVING = {
    jax.lax.broadcast_in_dim_p,
    jax.lax.convert_element_type_p,
    jax.lax.reshape_p,
    jax.lax.squeeze_p,
    jax.lax.copy_p,
}


class _ScaleBarrier:
    """Cut the chains of scalar scale ops for XLA's fusion (see ScalifyConfig.scale_barrier).

    XLA duplicates chains of cheap scalar ops into every consumer fusion; scales computed
    layer after layer form such chains, and the duplicates grow quadratically with depth
    (and with them compile time). A float
    division is "expensive" to XLA and is never duplicated, so `s / one` with a run-time
    `one` ends a chain, at the price of one small kernel on the GPU. The barrier tracks
    the depth of each new scale (1 + the deepest input scale; inputs, barrier outputs and
    scales a rule cut where it made them, `scale_flow.is_cut`, have depth 0; a rule that
    returns an input's scale adds nothing) and divides when the
    depth reaches `every`. The division is `scale_flow.cut_scale`; its run-time one
    (`scale_flow.seed_scale_barrier`) is computed once per JAX trace from a scale with no
    operation behind it: the first traced scale of the scalified function's arguments
    before their input guard, else of the interpreted jaxpr's inputs, else the first scale
    the barrier meets.
    """

    def __init__(self, every: int, args=()):
        self.every = every
        self.seed = _first_traced_scale(args)
        self.depth: dict[int, tuple[Any, int]] = {}  # id(scale) -> (scale, depth)

    def _depth(self, s) -> int:
        entry = self.depth.get(id(s))
        return entry[1] if entry is not None and entry[0] is s else 0

    def input_depth(self, invals) -> int:
        return max((self._depth(x.scale) for x in invals if isinstance(x, ScaledArray)), default=0)

    def __call__(self, x, in_depth: int, in_scales: list):
        if not isinstance(x, ScaledArray) or not isinstance(x.scale, jax.core.Tracer):
            return x
        s = x.scale
        if any(s is t for t in in_scales) or is_cut(s):  # passed through or cut already: depth 0
            return x
        depth = in_depth + 1
        if depth < self.every:
            self.depth[id(s)] = (s, depth)
            return x
        if memo_get(("barrier one", s.dtype), ()) is None:
            seed_scale_barrier(s if self.seed is None else self.seed)
        return unchecked_scaled(x.data, cut_scale(s))  # x's scale: no need to re-check it


def _first_traced_scale(args):
    return next((a.scale for a in args if isinstance(a, ScaledArray) and isinstance(a.scale, jax.core.Tracer)), None)


def seed_barrier(args) -> None:
    """Compute the scale barrier's `one` from the first traced scale of `args` (the
    arguments of the scalified function, before any scale operation)."""
    s0 = _first_traced_scale(args)
    if s0 is not None and (get_config().scale_barrier or get_config().data_barrier):
        seed_scale_barrier(s0)


# ---------------------------------------------------------------------------------------
# The interpreter loop
# ---------------------------------------------------------------------------------------
def _user_source(eqn):
    """Context in which ops emitted for `eqn` carry its traceback and name stack."""
    info = eqn.source_info
    return source_info_util.user_context(
        info.traceback, name_stack=source_info_util.current_name_stack() + info.name_stack)


def user_frame(eqn):
    """The innermost frame of `eqn`'s traceback in the user's code (not in JAX, Flax, optax,
    Equinox, NumPy, scalify or Python's standard library: `is_library_file`), or None."""
    try:
        frames = getattr(eqn.source_info.traceback, "frames", None) or ()
    except Exception:  # pragma: no cover - depends on JAX internals
        return None
    return next((fr for fr in frames if not is_library_file(fr.file_name)), None)


def format_frame(fr) -> str:
    """`file:line (function)` of a traceback frame."""
    return f"{fr.file_name}:{fr.line_num} ({fr.function_name})"


def source_line(eqn) -> str:
    """The user's line of `eqn`: the innermost traceback frame outside the libraries
    (`user_frame`), else JAX's summary, else its name stack and primitive (never empty)."""
    name_stack = ""
    fr = user_frame(eqn)
    if fr is not None:
        return format_frame(fr)
    try:
        line = source_info_util.summarize(eqn.source_info)
        if line and not is_library_file(line):
            return line
        name_stack = str(eqn.source_info.name_stack)
    except Exception:  # pragma: no cover - depends on JAX internals
        pass
    where = f"{name_stack}/{eqn.primitive.name}" if name_stack else eqn.primitive.name
    return f"'{where}' inside a JAX library function"


# Packages whose frames are not the user's: JAX, the libraries built on it, NumPy.
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "equinox", "chex", "numpy", "ml_dtypes", "opt_einsum")


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[str, ...]:
    """Folders of scalify and of `_LIBRARIES` (found without importing them)."""
    import importlib.util

    dirs = [os.path.dirname(os.path.abspath(__file__)) + os.sep]  # this module is in scalify/
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # pragma: no cover - a broken installation
            spec = None
        for loc in (spec.submodule_search_locations or ()) if spec is not None else ():
            dirs.append(os.path.abspath(loc) + os.sep)
    return tuple(dirs)


@functools.lru_cache(maxsize=None)
def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Python's standard library folders, and the package folders inside them (whose
    packages, the user's own included, are not the standard library)."""
    import sysconfig

    paths = sysconfig.get_paths()
    std = tuple({os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths})
    packages = tuple({os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib") if k in paths})
    return std, packages


def is_library_file(path: str) -> bool:
    """Whether a source file belongs to scalify, JAX, Flax, optax, Equinox, NumPy or Python's
    standard library (frozen modules included): frames there are not the user's."""
    if path.startswith(_library_dirs()) or path.startswith("<frozen"):
        return True
    std, packages = _stdlib_dirs()
    return path.startswith(std) and not path.startswith(packages)


def _call_site(fn) -> str:
    """`fn` and the innermost caller line outside the libraries (for messages)."""
    import traceback

    user = [f for f in traceback.extract_stack() if not is_library_file(f.filename)]
    name = getattr(fn, "__name__", repr(fn))
    return f"{name} called at {user[-1].filename}:{user[-1].lineno}" if user else name


def _unsupported(eqn, outer=None, fn=None) -> UnsupportedPrimitiveError:
    name = eqn.primitive.name
    where = source_line(eqn)
    if outer is not None:  # the user's call that contains eqn (e.g. jnp.linalg.cholesky)
        where = f"{source_line(outer)}, inside its '{outer.primitive.name}'"
    if fn is not None and "inside a JAX library function" in where:
        where += f", in the scalified function {_call_site(fn)}"
    err = UnsupportedPrimitiveError(
        f"scalify has no scale rule for primitive '{name}' (at {where}), which "
        f"received a ScaledArray input. Either register one:\n"
        f"    @scalify.register_scale_rule(<the '{name}' primitive>)\n"
        f"    def _{name.replace('-', '_')}_rule(*inputs, **params): ...\n"
        "(see docs/concepts.md, 'Adding a rule'), or wrap the code in a function decorated "
        "with `@scalify.custom_scale` and give it a scale rule with `.defscale`."
    )
    err.eqn = eqn  # type: ignore[attr-defined]
    return err


def _locate(err, jaxpr, fn):
    """Rebuild an UnsupportedPrimitiveError met inside a sub-jaxpr with the line of the
    top-level equation of `jaxpr` that contains it (and the scalified call's line)."""
    eqn = getattr(err, "eqn", None)
    if eqn is None:
        return err
    if any(e is eqn for e in jaxpr.eqns):
        return _unsupported(eqn, None, fn)

    def contains(j) -> bool:
        return any(e is eqn or any(contains(getattr(s, "jaxpr", s)) for s in jex.jaxprs_in_params(e.params)) for e in j.eqns)

    for top in jaxpr.eqns:
        if any(contains(getattr(s, "jaxpr", s)) for s in jex.jaxprs_in_params(top.params)):
            return _unsupported(eqn, top, fn)
    return _unsupported(eqn, None, fn)


def _check_outputs(eqn, outs) -> None:
    for var, out in zip(eqn.outvars, outs):
        aval = var.aval
        if not hasattr(aval, "shape"):
            continue
        got_shape = tuple(np.shape(out.data if isinstance(out, ScaledArray) else out))
        got_dtype = jnp.result_type(out.data if isinstance(out, ScaledArray) else out)
        if got_shape != tuple(aval.shape) or got_dtype != aval.dtype:
            raise AssertionError(
                f"scale rule of '{eqn.primitive.name}' returned {got_dtype}{list(got_shape)}, "
                f"expected {aval.dtype}{list(aval.shape)} (at {source_line(eqn)}). This is "
                "a bug in the rule."
            )


def interpret_jaxpr(jaxpr, consts: Sequence[Any], args: Sequence[Any], scalars=None) -> list:
    """Evaluate `jaxpr` on values that may be ScaledArray; returns the list of outputs.

    Args:
      jaxpr: an open `jax.extend.core.Jaxpr` (use `closed.jaxpr` and `closed.consts`).
      consts: values of its constvars.
      args: values of its invars (ScaledArray or plain arrays / scalars).
      scalars: optional broadcast-scalar metadata of `args` (0-d values or None).
    """
    with scale_cache():  # memoized scale arithmetic (shared with nested interpretations)
        return _interpret(jaxpr, consts, args, scalars)


def _interpret(jaxpr, consts, args, scalars) -> list:
    env: dict[Any, Any] = {}
    scalar_of: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    def read_scalar(v):
        if isinstance(v, jex.Literal):
            return v.val if np.ndim(v.val) == 0 else None
        val = env[v]
        if not isinstance(val, ScaledArray) and np.ndim(val) == 0:
            return val
        return scalar_of.get(v)

    def write(v, val, scalar=None):
        if isinstance(v, jex.DropVar):
            return
        env[v] = val
        if scalar is not None:
            scalar_of[v] = scalar

    scalars = scalars if scalars is not None else [None] * len(args)
    bounds = None  # static value bounds of jaxpr's variables, computed when a rule asks
    every = get_config().scale_barrier
    barrier = _ScaleBarrier(every, args) if every else None
    rule_scopes = get_config().rule_scopes
    for v, c in zip(jaxpr.constvars, consts):
        write(v, c)
    for v, a, s in zip(jaxpr.invars, args, scalars):
        write(v, a, s)

    def run(eqn):
        invals = [read(v) for v in eqn.invars]
        any_scaled = any(isinstance(x, ScaledArray) for x in invals)
        info = lookup(eqn.primitive)
        if not any_scaled and not (info is not None and info.always):
            outs = bind_as_is(eqn.primitive, eqn.params, invals, eqn)
            scalar = None
            if eqn.primitive in _SCALAR_PRESERVING and is_float(outs[0]):
                scalar = read_scalar(eqn.invars[0])
            for v, o in zip(eqn.outvars, outs):
                write(v, o, scalar)
            return
        if info is None:
            raise _unsupported(eqn)
        in_scalars = [read_scalar(v) for v in eqn.invars]
        scope = jax.named_scope(f"scalify.{eqn.primitive.name}") if rule_scopes else contextlib.nullcontext()
        if info.kind == "call":
            with scope:
                outs = info.fn(invals, in_scalars, **eqn.params)
        else:
            promoted = promote_inputs(invals, in_scalars)
            extra = {}
            if info.value_bounds:
                nonlocal bounds
                bounds = value_bounds(jaxpr) if bounds is None else bounds
                extra["value_bounds"] = tuple(bound_of(bounds, v) for v in eqn.invars)
            with scope:
                outs = info.fn(*promoted, **eqn.params, **extra)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            outs = [as_plain_scaled(o) for o in outs]
            if barrier is not None:
                in_scales = [x.scale for x in promoted if isinstance(x, ScaledArray)]
                depth = barrier.input_depth(promoted)
                outs = [barrier(o, depth, in_scales) for o in outs]
        _check_outputs(eqn, outs)
        if observe.active():
            observe.notify(eqn, outs, invals)
        for v, o in zip(eqn.outvars, outs):
            write(v, o)

    for eqn in fold_zero_scatter_adds(jaxpr):
        # What the rule emits carries the user's line and name stack (as jax.core.eval_jaxpr
        # does): profiles and the compiled HLO's metadata name the model's own ops.
        with _user_source(eqn):
            if observe.active():
                with observe.running(eqn):
                    run(eqn)
            else:
                run(eqn)
    return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------
def _is_dynamic(x) -> bool:
    """Arrays and Python numbers are traced (as jax.jit does); Python bools, strings and any
    other object are static (part of the cache key), so flags like `train=True` just work."""
    if isinstance(x, (bool, np.bool_)):
        return False
    return isinstance(x, (ScaledArray, jax.Array, np.ndarray, np.generic, int, float, complex))


def _is_dynamic_under_trace(x) -> bool:
    """`_is_dynamic` for a call made while an outer JAX transform traces (`jax.jit`,
    `jax.grad`, `jax.vmap`, ...): there a Python number is a value the outer transform
    left static (`jax.jit(scalify(f), static_argnums=...)`) or a constant of the traced
    function, never one of its traced arguments (those arrive as tracers), so it stays a
    Python value, usable as a shape or a loop count, as it is in the outer function."""
    if isinstance(x, (int, float, complex)):
        return False
    return _is_dynamic(x)


def _under_outer_trace() -> bool:
    """Whether a JAX transform is tracing the current call."""
    try:
        from jax._src import core as _core

        return not _core.trace_state_clean()
    except (ImportError, AttributeError):  # pragma: no cover - JAX internals moved
        return False


def _abstract(x):
    if isinstance(x, ScaledArray):
        x = x.data
    if isinstance(x, (int, float, bool, complex)):
        x = jnp.asarray(x)  # weakly typed, like jax.jit
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def scalify(fn: Callable, *, static_argnums=(), static_argnames=()) -> Callable:
    """Transform `fn` so that it propagates scales through every operation.

    The returned function takes the same arguments (pytrees of ScaledArray, arrays, Python
    scalars, and static non-array values) and returns `fn`'s outputs, scaled wherever a scale
    was propagated. With float32 data and power-of-two scales the values equal `fn`'s (model
    invariance); with no ScaledArray input the result is bit-identical to `fn`.

    As with `jax.jit`, `static_argnums` / `static_argnames` name arguments passed to `fn` as
    Python values (hashed into the trace cache key); non-array leaves (bools, strings, ...)
    are static too, and so is every non-array leaf of an Equinox module (as under
    `eqx.filter_jit`). Python numbers are traced when the call is eager, and static when
    an outer transform traces it (`jax.jit(scalify(f), static_argnums=1)(x, 3)`: the outer
    jit's static argument reaches `fn` as the int 3). Static values must be hashable. Up to
    64 traced jaxprs are cached per function (per input structure, avals, static values
    and ScalifyConfig).

    Scaled arguments' scales must be powers of two: a concrete one that is not is an error
    (`ScaleError`). Under `jax.jit`, `scaled_array(data, scale)` splits a traced scale
    exactly (`scalify.core.scaled_array.exact_pow2_scale`: the mantissa goes into the
    data); a `ScaledArray(data, scale)` built directly is trusted.

    Flax NNX modules, optimizers and Variables among the arguments keep NNX semantics: what
    `fn` changes in place is written back into them, as by `nnx.jit` (scalify/frameworks.py).

    `jax.grad` of a function calling the result on ScaledArrays differentiates the VALUES:
    the cotangent of a ScaledArray input is a ScaledArray whose value is dL/dx (see
    scalify/outer_ad.py).
    """
    nums = _normalize_static(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    bound = frameworks.module_call(fn)  # scalify(model): the module becomes argument 0
    if bound is None:
        return _scalify(fn, nums, names, True)
    module, call = bound
    inner = _scalify(call, tuple(n + 1 if n >= 0 else n for n in nums), names, True)

    @functools.wraps(fn, updated=())  # not the module's __dict__
    def wrapper(*args, **kwargs):
        return inner(module, *args, **kwargs)

    wrapper.cache_size = inner.cache_size  # type: ignore[attr-defined]
    return wrapper


_CACHE_SIZE = 64


def _normalize_static(nums) -> tuple:
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    if not all(isinstance(n, (int, np.integer)) for n in nums):
        raise TypeError(f"scalify: static_argnums must be ints, got {nums!r}.")
    return tuple(int(n) for n in nums)


def _scalify(fn, static_argnums, static_argnames, value_ad):
    cache = LRUCache(_CACHE_SIZE)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nargs = len(args)
        snums = {n % nargs for n in static_argnums if -nargs <= n < nargs}
        s_args = tuple((i, args[i]) for i in sorted(snums))
        s_kwargs = tuple(sorted((k, kwargs[k]) for k in static_argnames if k in kwargs))
        d_args = tuple(None if i in snums else a for i, a in enumerate(args))
        d_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
        tree = (d_args, d_kwargs)
        graph = frameworks.GraphArgs.split(tree)  # NNX nodes: split, updated in place after
        if graph is not None:
            tree = graph.tree
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_scaled_leaf)
        dynamic = frameworks.dynamic_mask(tree, _is_dynamic_under_trace if _under_outer_trace() else _is_dynamic)
        dyn_leaves = [x for x, d in zip(leaves, dynamic) if d]
        avals = [_abstract(x) for x in dyn_leaves]
        statics = tuple(x for x, d in zip(leaves, dynamic) if not d)
        _check_hashable(fn, tree, dynamic, s_args, s_kwargs)
        scaled = tuple(isinstance(x, ScaledArray) for x in dyn_leaves)
        key = (treedef, tuple(dynamic), scaled, tuple(avals), statics, s_args, s_kwargs, get_config())
        entry = cache.get(key)
        if entry is None:
            full = functools.partial(_with_statics, fn, dict(s_args), dict(s_kwargs))
            call = lambda args_kwargs: full(*args_kwargs[0], **args_kwargs[1])  # noqa: E731
            if graph is not None:
                call = graph.wrap(lambda args, kwargs: full(*args, **kwargs))
            entry = _trace(call, treedef, dynamic, leaves, avals, fn)
            cache.put(key, entry)
        closed, out_info = entry
        in_vals = [x if isinstance(x, ScaledArray) else jnp.asarray(x) for x in dyn_leaves]
        if value_ad and any(scaled) and under_reverse_ad():
            inner = lambda f: _scalify(f, (), (), False)  # noqa: E731
            outs = call_with_value_vjp(_interpret_guarded, inner, closed.jaxpr, closed.consts, in_vals)
        else:
            try:
                outs = _interpret_guarded(closed.jaxpr, closed.consts, in_vals)
            except UnsupportedPrimitiveError as err:
                located = _locate(err, closed.jaxpr, fn)
                if located is err:
                    raise
                raise located from None
        out = _rebuild_output(out_info, outs)
        return out if graph is None else graph.finish(out)

    wrapper.cache_size = lambda: len(cache)  # type: ignore[attr-defined]
    return wrapper


def _interpret_guarded(jaxpr, consts, args) -> list:
    """`interpret_jaxpr` after the input guard (`ScalifyConfig.input_drift_window`): the
    scaled arguments of a scalified function enter with unit data. Inside a shard_map body
    the guard and the output scales agree over its manual axes (scalify/core/spmd.py)."""
    axes = manual_axes()
    with scale_cache():
        seed_barrier(args)
        _check_pow2_inputs(args)
        outs = interpret_jaxpr(jaxpr, consts, rebalance_inputs(args, get_config().input_drift_window, axes))
    return agree_scales(outs, axes) if axes else outs


def _check_pow2_inputs(args) -> None:
    """Check that the scaled arguments' concrete scales are powers of two, as the rules
    assume (`ScaleError` otherwise: a ScaledArray rebuilt by pytree operations skips
    the constructor's check). A traced scale is taken as it is: scalify's outputs,
    `scaled_array` and `as_scaled_array` make powers of two under `jax.jit` too."""
    for x in args:
        if isinstance(x, ScaledArray) and not isinstance(x.scale, jax.core.Tracer):
            check_pow2_scale(x)


def _with_statics(fn, s_args, s_kwargs, *args, **kwargs):
    args = [s_args[i] if i in s_args else a for i, a in enumerate(args)]
    return fn(*args, **kwargs, **s_kwargs)


def _check_hashable(fn, tree, dynamic, s_args, s_kwargs) -> None:
    bad = [(f"argument {i}", v) for i, v in s_args if not _hashable(v)]
    bad += [(f"argument '{k}'", v) for k, v in s_kwargs if not _hashable(v)]
    if not all(dynamic):
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_scaled_leaf)
        for where, v, d in zip(frameworks.leaf_names(tree), leaves, dynamic):
            if not d and not _hashable(v):
                bad.append((f"the non-array leaf {where}", v))
    if bad:
        what, v = bad[0]
        name = getattr(fn, "__name__", repr(fn))
        raise ScaledTypeError(
            f"scalify({name}): {what} is a static value of type {type(v).__name__} that is "
            "not hashable. Static values (static_argnums/static_argnames and non-array "
            "leaves) are part of the trace cache key, as with jax.jit. Pass a hashable value "
            "(a tuple instead of a list, a frozen dataclass), pass arrays instead, or bind it "
            "with functools.partial before scalify."
        )


def _hashable(v) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def _trace(call, treedef, dynamic, leaves, avals, fn):
    """Trace `call(tree)` (tree: the arguments, rebuilt from `treedef` with tracers for the
    dynamic leaves) to a ClosedJaxpr; returns it and the output's (treedef, dynamic mask,
    static leaves): outputs that are not JAX values (functions, strings, None) and the
    non-array fields of returned Equinox modules are returned as the trace saw them."""
    out_tree_box = []

    def flat_fn(*dyn):
        it = iter(dyn)
        full = [next(it) if d else x for x, d in zip(leaves, dynamic)]
        tree = jax.tree_util.tree_unflatten(treedef, full)
        try:
            out = call(tree)
        except Exception as err:
            note = frameworks.traced_number_note(fn, jax.tree_util.tree_unflatten(treedef, leaves), leaves, dynamic)
            if note is not None and hasattr(err, "add_note"):
                err.add_note(note)
            raise
        flat, out_tree = jax.tree_util.tree_flatten(out, is_leaf=is_scaled_leaf)
        if any(isinstance(o, ScaledArray) for o in flat):
            raise ScaledTypeError(
                "A function transformed by scalify returned a ScaledArray built inside it. "
                "Inside scalify use `scalify.set_scaling` to choose a scale instead of "
                "constructing ScaledArray directly."
            )
        out_dynamic = frameworks.dynamic_mask(out, _is_output_dynamic)
        out_statics = [None if d else o for o, d in zip(flat, out_dynamic)]
        out_tree_box.append((out_tree, out_dynamic, out_statics))
        return [o for o, d in zip(flat, out_dynamic) if d]

    closed = jax.make_jaxpr(flat_fn)(*avals)
    return closed, out_tree_box[0]


def _is_output_dynamic(x) -> bool:
    """An output leaf that JAX returns as an array (arrays, tracers, Python numbers)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex))


def _rebuild_output(out_info, outs):
    out_tree, out_dynamic, out_statics = out_info
    it = iter(outs)
    flat = [next(it) if d else o for o, d in zip(out_statics, out_dynamic)]
    return jax.tree_util.tree_unflatten(out_tree, flat)
