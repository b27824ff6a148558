"""Errors raised by scalify. Each says what happened and what to do about it."""


class ScalifyError(Exception):
    """Base class of every error scalify raises on purpose."""


class ScaleError(ScalifyError, ValueError):
    """A scale is invalid: not a power of two, wrong shape, or given to integer data."""


class UnsupportedPrimitiveError(ScalifyError, NotImplementedError):
    """The scalify interpreter met a primitive with a scaled input and no scale rule."""


class ScaledTypeError(ScalifyError, TypeError):
    """A ScaledArray went somewhere that only accepts plain arrays (or the reverse)."""


class OuterTransformError(ScalifyError, ValueError):
    """A JAX transform applied outside `scalify` (e.g. `jax.grad`) met a ScaledArray where it
    needs a plain array."""
