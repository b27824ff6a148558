"""ScaledArray: a tensor represented as `data * scale`.

`data` keeps the shape and a (possibly 8- or 16-bit) float dtype; `scale` is a power of
two (float32 by default), a scalar or any shape that broadcasts to `data`.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalify.core.config import get_config
from scalify.core.errors import OuterTransformError, ScaledTypeError, ScaleError
from scalify.core.lax_utils import widen
from scalify.core.pow2 import is_pow2, pow2_round, split_pow2, split_scale

_GENERIC_SCALARS = (int, float, np.floating, np.integer)


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """A tensor `x = data * scale`, a JAX pytree with children (data, scale).

    `shape`, `dtype`, `ndim` and `size` are those of `data`. Build one with
    `scaled_array(data, scale)` (checked) or `as_scaled_array(x)`; the plain constructor
    checks the same things when both children are concrete arrays.

    Outside a trace a ScaledArray converts like a NumPy array: `float(x)`, `int(x)`,
    `bool(x)`, `x.item()` (size-1 values), `f"{x:.3f}"` and `np.asarray(x)` use the value
    `data * scale`. Arithmetic operators, comparisons and indexing raise `ScaledTypeError`:
    compute on ScaledArrays inside a function transformed with `scalify.scalify`.
    """

    __slots__ = ("data", "scale")
    __array_priority__ = 1000  # so that NumPy defers to us in mixed expressions

    def __init__(self, data, scale):
        # An int data with a None scale is an axis spec (`jax.vmap(..., in_axes=
        # ScaledArray(0, None))`), not a value.
        axis_spec = isinstance(data, int) and scale is None
        if (data is None or scale is None) and not axis_spec:
            missing = "data" if data is None else "scale"
            raise ScaleError(
                f"ScaledArray {missing} is missing (got None). Pass both children, e.g. "
                "`ScaledArray(data, jnp.float32(1.0))` or `scalify.scaled_array(data, 1.0)` with "
                "a power-of-two scale, or let `scalify.as_scaled_array(x)` choose the scale."
            )
        self.data = data
        self.scale = scale
        _check(data, scale)

    # -- pytree -------------------------------------------------------------------
    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No checks here: JAX unflattens with placeholders (None, shardings, tracers).
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        return obj

    # -- array-like metadata --------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.data.shape))

    @property
    def aval(self):
        return jax.core.ShapedArray(self.shape, self.dtype)

    def to_array(self, dtype=None):
        """Materialise `data * scale` in `dtype`.

        `dtype=None` (default): the data's dtype for float16, bfloat16, float32 and float64
        data; float32 for 8-bit and narrower formats (FP8, FP6, FP4), whose dtypes JAX does
        not promote with others (`fp8.to_array() - ref` would fail) and whose range rarely
        holds the value (an FP8 tensor at scale 2^-20). Pass `dtype` to choose, e.g.
        `to_array(jnp.float8_e4m3fn)` for the value rounded to FP8.

        The product is computed in the wider of the data and scale dtypes (float32 for FP8 or
        FP16 data) and cast once at the end, so no intermediate overflows.
        """
        dtype = default_value_dtype(self.dtype) if dtype is None else jnp.dtype(dtype)
        compute = compute_dtype(self.dtype, dtype)
        # widen: FP8 data keeps its rounding on GPU (see scalify.core.lax_utils.widen).
        out = widen(self.data, compute) * jnp.asarray(self.scale).astype(compute)
        return out.astype(dtype)

    def __array__(self, dtype=None, copy=None):
        """`np.asarray(x)`: the value in `dtype` (default: `to_array`'s, the data's dtype,
        float32 for FP8 and narrower data). A value that does not fit that dtype (float16
        data at scale 2^20: inf; at 2^-30: 0) is what plain JAX would hold there, and a
        RuntimeWarning says so and how to get the value itself."""
        self._require_concrete("np.asarray(ScaledArray)")
        out = np.asarray(self.to_array(), dtype=dtype)
        if dtype is None:
            data = np.asarray(self.data)
            lost = (np.isinf(out) & np.isfinite(data)) | ((out == 0) & (data != 0))
            if np.any(lost):
                warnings.warn(
                    f"np.asarray(ScaledArray): {int(np.sum(lost))} of {out.size} values do not "
                    f"fit {out.dtype} (to_array's default dtype) and became inf or 0, as plain JAX would "
                    "hold them. Use `x.to_array(np.float32)`, `float(x)` or `x.item()` for the "
                    "values themselves.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return out

    def astype(self, dtype) -> "ScaledArray":
        """Same value with data cast to `dtype` (scale unchanged)."""
        return ScaledArray(jnp.asarray(self.data).astype(dtype), self.scale)

    # -- conversion to Python values (outside traces) -------------------------------------
    def _require_concrete(self, what: str) -> None:
        for name, child in (("data", self.data), ("scale", self.scale)):
            if isinstance(child, jax.core.Tracer):
                raise ScaledTypeError(
                    f"{what} needs a concrete value, but this ScaledArray's {name} is traced "
                    f"({_describe(child)}): it is an argument or intermediate of a function "
                    "being transformed by JAX (jax.jit, grad, vmap, scan, ...), whose values are "
                    "only known when it runs. Return the ScaledArray from the transformed "
                    "function and convert it outside, or print it inside with jax.debug.print."
                )
            if not is_concrete(child):
                raise ScaledTypeError(
                    f"{what} needs a concrete value, but this ScaledArray's {name} is "
                    f"{_describe(child)}, not an array (e.g. a shape placeholder from "
                    "jax.eval_shape). Build the ScaledArray from concrete arrays first."
                )

    def _value(self, what: str) -> np.ndarray:
        """The exact value `data * scale` as a NumPy array in the compute dtype."""
        self._require_concrete(what)
        return np.asarray(self.to_array(compute_dtype(self.dtype, _dtype_of(self.scale))))

    def item(self, *args):
        """The value as a Python scalar, like `np.ndarray.item` (no arguments: size-1 only)."""
        value = self._value("ScaledArray.item()")
        if not args and value.size != 1:
            raise ValueError(
                f"can only convert a ScaledArray of size 1 to a Python scalar; this one has shape "
                f"{self.shape}. Index the materialised value instead: `x.to_array()[i].item()` "
                "or `x.item(i)`."
            )
        return value.item(*args)

    def _scalar(self, what: str):
        value = self._value(what)
        if value.size != 1:
            raise ScaledTypeError(
                f"only size-1 ScaledArrays can be converted with {what}; this one has shape "
                f"{self.shape}. Materialise it with `x.to_array()` (or `np.asarray(x)`) and "
                "convert the element you need."
            )
        return value.item()

    def __float__(self) -> float:
        return float(self._scalar("float()"))

    def __int__(self) -> int:
        return int(self._scalar("int()"))

    def __complex__(self) -> complex:
        return complex(self._scalar("complex()"))

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(
                f"The truth value of a ScaledArray of shape {self.shape} is ambiguous. Use "
                "`x.to_array().any()` or `x.to_array().all()`."
            )
        return bool(self._scalar("bool()"))

    def __format__(self, format_spec: str) -> str:
        if not format_spec:
            return str(self)
        value = self._value(f"format(ScaledArray, {format_spec!r})")
        # As jax.Array: 0-d values format as scalars, other shapes as NumPy arrays do.
        return format(value[()] if value.ndim == 0 else value, format_spec)

    def __repr__(self) -> str:
        parts = [f"data={self.data!r}", f"scale={self.scale!r}"]
        if is_concrete(self.data) and is_concrete(self.scale):
            try:
                value = self._value("repr")
            except Exception:  # noqa: BLE001 -- a repr must not raise (e.g. bad children)
                pass
            else:
                text = np.array2string(value, separator=", ", prefix="ScaledArray(value=")
                parts.insert(0, f"value={text}")
        return f"ScaledArray({', '.join(parts)})"

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def __jax_array__(self):
        """JAX reads this attribute where it expects an array. `jnp` functions call it (the
        error below); JAX's own abstractification (`jax.grad`'s check of its output, a `lax`
        primitive) only looks it up, so the look-up itself raises there, with the fix for
        `jax.grad(scalify(f))`, instead of JAX's internal "abstractification" error."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "jax._src.core":
            raise OuterTransformError(
                "A ScaledArray reached JAX where an array is expected. If this is "
                "`jax.grad(scalify(f))` (or value_and_grad) and `f` returns a ScaledArray: "
                "differentiate its value, `jax.grad(lambda *a: scalify(f)(*a).to_array())`, or "
                "take the gradient inside, `scalify(jax.grad(f))`. Otherwise call the JAX "
                "function inside `scalify`, or convert with `x.to_array()`."
            )
        return self._refuse_as_array

    def _refuse_as_array(self):
        raise ScaledTypeError(
            "A ScaledArray was passed to a JAX function that expects a plain array. Call it "
            "inside a function transformed with `scalify.scalify`, or convert explicitly with "
            "`x.to_array()` / `scalify.asarray(x)`."
        )

    # Identity hash, as for any object: `==` raises like the other operators (set below).
    __hash__ = object.__hash__


def _operator_error(symbol: str):
    def method(self, *args):
        raise ScaledTypeError(
            f"ScaledArray does not support `{symbol}` outside scalify: operators on "
            "ScaledArray only work inside a function transformed with `scalify.scalify`, "
            "which sees plain arrays and propagates the scales. Wrap the computation in a "
            "function and call `scalify.scalify(fn)(x, ...)`, or materialise the value first "
            "with `x.to_array()` / `scalify.asarray(x)`."
        )

    return method


_OPERATORS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "divmod": "divmod", "pow": "**", "matmul": "@", "and": "&", "or": "|", "xor": "^",
    "lshift": "<<", "rshift": ">>",
}
for _name, _symbol in _OPERATORS.items():
    for _prefix in ("", "r", "i"):
        if _prefix == "i" and _name == "divmod":
            continue
        setattr(ScaledArray, f"__{_prefix}{_name}__", _operator_error(_symbol))
for _name, _symbol in {
    "neg": "-x", "pos": "+x", "abs": "abs()", "invert": "~", "round": "round()",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    "getitem": "x[...]", "setitem": "x[...] = ...", "iter": "iteration",
}.items():
    setattr(ScaledArray, f"__{_name}__", _operator_error(_symbol))
del _name, _symbol, _prefix


def _describe(x) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(x).__name__} {jnp.dtype(dtype).name}{list(shape)}"
    return type(x).__name__


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def default_value_dtype(dtype):
    """The dtype in which `ScaledArray.to_array()` returns the value of data of `dtype`:
    `dtype` itself for 16-bit and wider floats, float32 for 8-bit and narrower formats."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 2 else dtype


def compute_dtype(*dtypes):
    """The dtype in which scale arithmetic on `dtypes` is done: float64 if any is float64,
    else float32 (FP8, FP16 and BF16 data are up-cast; no implicit FP8 promotion in JAX)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def has_float32_range(dtype) -> bool:
    """Whether float `dtype` covers float32's exponent range (bfloat16, float32, float64):
    it holds every finite float32 magnitude, so values need no scale to stay in range."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp


def is_concrete(x) -> bool:
    """Whether x is a concrete (non-traced) array or number."""
    return isinstance(x, (np.ndarray, np.generic, *_GENERIC_SCALARS)) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )


def broadcasts_to(shape, target) -> bool:
    """Whether an array of `shape` (a scale) broadcasts to `target` (its data's shape)
    without changing it."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def _check(data, scale) -> None:
    """Construction checks, on what is known statically (and values when concrete)."""
    if not (hasattr(data, "dtype") and hasattr(scale, "dtype") or is_concrete(scale)):
        return  # placeholders from pytree machinery
    if not hasattr(data, "dtype"):
        return
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise ScaleError(
            f"ScaledArray data must be a floating-point array, got dtype {data.dtype}. Integer "
            "and boolean values are never scaled: pass them as plain arrays."
        )
    scale_dtype = scale.dtype if hasattr(scale, "dtype") else np.asarray(scale).dtype
    if not jnp.issubdtype(scale_dtype, jnp.floating):
        raise ScaleError(f"ScaledArray scale must be a float array, got dtype {scale_dtype}.")
    scale_shape = np.shape(scale)
    if not broadcasts_to(scale_shape, data.shape):
        raise ScaleError(
            f"ScaledArray scale of shape {scale_shape} does not broadcast to data of shape "
            f"{tuple(data.shape)}. Use a scalar scale or a shape that broadcasts to the data "
            "(e.g. (n, 1) for per-row scales)."
        )
    if is_concrete(scale):
        _check_pow2(np.asarray(scale, dtype=np.float64))


def _check_pow2(s: np.ndarray) -> None:
    bad = ~is_pow2(s)
    if bad.any():
        raise ScaleError(
            f"ScaledArray scale must be a positive power of two, got {s[bad].ravel()[:4]}. "
            "Round it with `scalify.pow2_round`, or use `as_scaled_array(x)` which splits a "
            "value exactly into mantissa and power-of-two scale."
        )


def _as_scale(scale, npapi=jnp):
    """`scale` as an array of the configured scale dtype, checked before the cast when
    concrete: a power of two the scale dtype cannot hold is an error (no silent inf or 0)."""
    if scale is None:
        raise ScaleError(
            "ScaledArray scale is missing (got None). Pass a power-of-two scale, e.g. "
            "`scalify.scaled_array(data, 1.0)`, or let `scalify.as_scaled_array(x)` choose it."
        )
    sdtype = np.dtype(get_config().scale_dtype)
    if isinstance(scale, jax.core.Tracer) or not (is_concrete(scale) or isinstance(scale, (list, tuple))):
        return npapi.asarray(scale, dtype=sdtype)
    given = np.asarray(scale, dtype=np.float64)
    _check_pow2(given)
    with np.errstate(over="ignore", under="ignore"):
        cast = given.astype(sdtype)
    lost = cast.astype(np.float64) != given
    if lost.any():
        value = float(given[lost].ravel()[0])
        exponent = int(np.frexp(value)[1]) - 1
        finfo = jnp.finfo(sdtype)
        smallest = int(np.log2(float(finfo.smallest_subnormal)))
        what = "overflows" if exponent > 0 else "underflows"
        raise ScaleError(
            f"ScaledArray scale {value!r} (2^{exponent}) {what} the scale dtype {sdtype.name}, "
            f"which holds powers of two from 2^{int(finfo.minexp)} to 2^{int(finfo.maxexp) - 1} "
            f"(down to 2^{smallest} as subnormals). Choose a scale in that range and keep the "
            "rest of the factor in the data, or set a wider `ScalifyConfig(scale_dtype=...)` (float64 needs jax_enable_x64)."
        )
    return npapi.asarray(cast)


def is_scaled_leaf(x: Any) -> bool:
    """`is_leaf` predicate for jax.tree_util: stops at ScaledArray (and at plain leaves)."""
    return isinstance(x, ScaledArray)


def is_float(x) -> bool:
    """Whether `x` holds floating-point values: a ScaledArray, an array or tracer of a float
    dtype, a NumPy float scalar or a Python float (never an integer, bool or complex)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    return jnp.issubdtype(dtype, jnp.floating)


def scaled_array(data, scale, dtype=None, npapi=jnp) -> ScaledArray:
    """Construct a checked ScaledArray from data and scale.

    Args:
      data: array-like of float values.
      scale: a power of two, scalar or broadcastable to `data`.
      dtype: optional dtype of `data` (cast exactly as `data.astype(dtype)`).
      npapi: `jnp` (default) or `np` for host arrays.
    Returns:
      ScaledArray(data, scale) with scale in the configured scale dtype.

    A concrete scale that is not a power of two is an error. A traced one (under
    `jax.jit`, `jax.grad`, ...), whose value is not known here, is split exactly: the
    ScaledArray holds `data * m` at scale `p`, with `scale = m * p`, `p` a power of two
    and m in [1, 2) (`exact_pow2_scale`), so its value is `data * scale` rounded once, as
    plain JAX computes it.
    """
    data = npapi.asarray(data, dtype=dtype)
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise ScaleError(
            f"scaled_array data must be floating point, got {data.dtype}; integer and "
            "boolean arrays are never scaled."
        )
    scale = _as_scale(scale, npapi)
    if isinstance(scale, jax.core.Tracer):
        _check(data, scale)  # dtype and shape
        return exact_pow2_scale(ScaledArray.tree_unflatten(None, (data, scale)))
    return ScaledArray(data, scale)


def exact_pow2_scale(x: ScaledArray) -> ScaledArray:
    """`x` with its scale made a power of two, value unchanged: scale s = m * p
    (`scalify.core.pow2.split_scale`: p a power of two, m in [1, 2) with s's sign) becomes
    data `x.data * m` at scale p. For a power-of-two s (m = 1) data and scale are
    unchanged, bit for bit; otherwise the data are rounded once to their dtype, as
    `data * s` would be in plain JAX (float16 data within a factor m of float16's max
    overflow there). A scale of 0 or inf stays (mantissa 1). For scales whose value is
    not known when the ScaledArray is built (traced under `jax.jit`): `scaled_array`
    passes them through this."""
    scale = jnp.asarray(x.scale)
    p, m = split_scale(scale)
    cdt = compute_dtype(x.dtype, m.dtype)
    # A plain conversion (not `widen`'s optimization barrier, which would keep XLA from
    # fusing the multiply into the data's consumers): FP8 data times 1 convert back exactly,
    # and an FP8 -> float32 -> FP8 round trip that XLA folds only skips a rounding.
    data = (jnp.asarray(x.data).astype(cdt) * m.astype(cdt)).astype(x.dtype)
    return ScaledArray.tree_unflatten(None, (data, p))


def check_pow2_scale(x: ScaledArray) -> None:
    """Raise `ScaleError` if the concrete scale of `x` is not a positive power of two (a
    ScaledArray rebuilt by pytree operations, e.g. `jax.tree.map(lambda t: t * 3, x)`,
    skips the constructor's check). Scales that cannot be read on this host are skipped."""
    scale = x.scale
    if not is_concrete(scale) or not getattr(scale, "is_fully_addressable", True):
        return
    _check_pow2(np.asarray(scale, dtype=np.float64))


def as_scaled_array(tree: Any, scale=None) -> Any:
    """Convert the float leaves of a pytree to ScaledArray; other leaves stay as they are.

    - Python floats and 0-d arrays are split exactly: `x = mantissa * 2^e`.
    - Arrays get the power of two of their RMS as scale (rounded down), so their data has an
      RMS in [1, 2): the unit-variance data that the scale rules assume, whatever the
      initialisation (a Flax kernel of std 1/8 enters with scale 2^-3, not 1, and the
      backward pass does not drift by sqrt(K)/8 per layer). All-zero or non-finite arrays
      get scale 1. With `scale` given, every array gets that power of two (`scale=1.0` is
      the plain representation: data = x).
    - The split is exact (a power-of-two division) unless data under- or overflows; a
      given `scale` that makes a concrete array's data overflow its dtype is an error. A
      traced `scale` (under `jax.jit`) that is not a power of two is rounded down to one.
    - ScaledArray leaves are kept.
    - Inside an Equinox module only arrays are converted: its Python fields are options
      (a dropout rate), static under `scalify` as under `eqx.filter_jit`.
    """

    def convert(x):
        if isinstance(x, ScaledArray) or not is_float(x):
            return x
        sdtype = get_config().scale_dtype
        if scale is not None:
            s = _as_scale(scale)
            if isinstance(s, jax.core.Tracer):  # not checked: its power of two (x is the value)
                s = split_scale(s)[0]
            xa = jnp.asarray(x)
            cdt = compute_dtype(xa.dtype)
            data = (xa.astype(cdt) / s.astype(cdt)).astype(xa.dtype)
            if is_concrete(x) and is_concrete(s) and bool(jnp.any(jnp.isfinite(xa) & ~jnp.isfinite(data))):
                raise ValueError(
                    f"as_scaled_array: x / scale overflows {xa.dtype} (max |x| "
                    f"{float(jnp.max(jnp.abs(xa.astype(cdt))))}, scale {float(s)}); pass a larger "
                    "power-of-two scale, or scale=None for the power of two of x's RMS."
                )
            return ScaledArray(data, s)
        if isinstance(x, (float, np.floating)) or np.ndim(x) == 0:
            xa = jnp.asarray(x)
            mant, s = split_pow2(xa)
            return ScaledArray(mant, s.astype(sdtype))
        xa = jnp.asarray(x)
        s = rms_scale(xa)
        cdt = compute_dtype(xa.dtype)
        return ScaledArray((xa.astype(cdt) / s.astype(cdt)).astype(xa.dtype), s)

    module = getattr(sys.modules.get("equinox"), "Module", None)  # set iff eqx is imported
    if module is None:
        return jax.tree_util.tree_map(convert, tree, is_leaf=is_scaled_leaf)

    def convert_node(x):
        if not isinstance(x, module):
            return convert(x)
        arrays_only = lambda y: convert(y) if isinstance(y, (jax.Array, np.ndarray)) else y  # noqa: E731
        return jax.tree_util.tree_map(arrays_only, x, is_leaf=is_scaled_leaf)

    return jax.tree_util.tree_map(convert_node, tree, is_leaf=lambda x: isinstance(x, (ScaledArray, module)))


def rms_scale(x):
    """The power of two of x's RMS, rounded down (1 for an all-zero or non-finite x), in the
    configured scale dtype. Computed as m * sqrt(mean((x/m)^2)) with m = max|x|, so that
    squaring cannot overflow."""
    sdtype = get_config().scale_dtype
    x = jnp.asarray(x)
    x = x.astype(compute_dtype(x.dtype))
    m = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), x.dtype)
    ok = jnp.isfinite(m) & (m > 0)
    safe_m = jnp.where(ok, m, 1)
    rms = safe_m * jnp.sqrt(jnp.mean(jnp.square(x / safe_m))) if x.size else safe_m
    finfo = jnp.finfo(sdtype)
    s = pow2_round(jnp.clip(rms, finfo.tiny, finfo.max), "down")
    return jnp.where(ok, s, 1).astype(sdtype)


def asarray(tree: Any, dtype=None) -> Any:
    """Materialise every ScaledArray in a pytree (`data * scale`); other leaves unchanged."""
    return jax.tree_util.tree_map(
        lambda x: x.to_array(dtype) if isinstance(x, ScaledArray) else x,
        tree,
        is_leaf=is_scaled_leaf,
    )
