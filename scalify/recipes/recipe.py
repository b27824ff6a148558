"""A precision recipe: what runs in which format, as one small frozen object.

The five configurations of the Scalify paper's Table 3 (Balança et al. 2024):

==================  ====  ==================================================================
recipe              #     formats
==================  ====  ==================================================================
``FP32``            #0    float32 data, propagated scales (the reference)
``FP16``            #1    FP16 activations and matmuls; float32 master weights and state
``FP16_MASTER``     #2    #1 + FP16 master weights (scaled, one power of two per tensor)
``FP8``             #3    #2 + FP8 matmuls (E4M3 inputs and kernels, E5M2 gradients)
``FP8_FP16_STATE``  #4    #3 + Adam moments stored as scaled FP16
``FP8_BF16``        -     #3 with bfloat16 activations between the FP8 matmuls (the split of
                          TransformerEngine and torchao); FP16 master weights
==================  ====  ==================================================================

``FP8_BF16``'s activations and their gradients carry no scale: bfloat16 has float32's
exponent range, so the values themselves fit. Only the FP8 operands are scaled: the
kernels from their masters, each input and output gradient placed by its cast's drift
guard from the previous step's statistics; the FP8 GEMMs write plain bfloat16 values.
No matmul output needs a measured placement, no normalisation gradient a rescale, and the
ops between the matmuls run as in the plain model, with no scale arithmetic: fewer passes
over the activations and a smaller program than ``FP8``, whose float16 activations keep
the paper's format.

Every recipe transforms the whole training step (forward, backward, optimizer) with
`scalify.scalify`; `Recipe.train_step(loss_fn, optimizer)` builds it
(`scalify.recipes.train_step`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

__all__ = ["Recipe", "FP32", "FP16", "FP16_MASTER", "FP8", "FP8_FP16_STATE", "FP8_BF16", "RECIPES", "get"]

# Module names that stay in the model's own precision by default: the output head.
DEFAULT_KEEP = ("head", "lm_head", "logits")


def _dtype(x) -> Any:
    return None if x is None else jnp.dtype(x)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a scalified train step stores and computes in which format.

    Attributes:
      name: a label for logs and tables.
      compute_dtype: the dtype of every Flax linen module's `dtype` field during the step
        (activations and matmuls), e.g. float16; None keeps the model's own.
      fp8: run the matmuls of `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` with E4M3
        operands and E5M2 output gradients, quantised at the scales scalify propagates.
      master_dtype: storage of the parameters: float32, or float16 (each tensor a
        `ScaledArray` whose largest value has data in (1, 2]).
      state_dtype: storage of the optimizer state's float leaves of `state_min_size`
        elements or more: float32, or float16 (`scalify.optim.scaled_state`).
      state_min_size: smaller leaves (biases, norms) keep a float32 state.
      norm_grad_rescale: rescale the input gradient of every linen `LayerNorm` and
        `RMSNorm`, and of modules whose class name ends with "RMSNorm" or "LayerNorm"
        (hand-written ones), to unit RMS (`scalify.ops.dynamic_rescale_l2_grad`).
      delayed_statistics: the scale decisions that depend on the data (the drift guards,
        the placement of float16 matmul outputs) are taken from the previous step's
        measurements, carried in `TrainState.statistics` (`scalify.core.statistics`): one
        pass over each tensor instead of two. False: from this step's.
      fp8_saved_activations: keep the inputs of the normalisations (as `norm_grad_rescale`
        finds them) and of `gelu`, `silu` and `swish` for the backward pass in E4M3, one
        power-of-two scale per 16 elements of the last axis (COAT's group scaling,
        `scalify.ops.saved_activations.GROUP16`), instead of in their own dtype: the
        forward is unchanged, the backward runs at the dequantised inputs.
      recompute_fp8_weights: with `fp8` and a `compute_dtype`, cast each `nn.Dense`
        kernel's FP8 copy that the backward pass reads again from the kernel in the backward
        pass, rather than keep the forward's copy until then: the values kept for the
        backward pass hold one byte per kernel element less (the kernel, a parameter, is
        held anyway), for one more read of each kernel a step. The same values.
      keep: modules left in the model's own precision (no `compute_dtype`, no FP8): a
        callable `path -> bool` on the module path ("Block_0/lm_head"), or names that
        match a path component. A head tied to the embedding (`nn.Embed.attend`) always
        keeps the model's precision.
    """

    name: str
    compute_dtype: Any = None
    fp8: bool = False
    master_dtype: Any = jnp.float32
    state_dtype: Any = jnp.float32
    state_min_size: int = 4096
    norm_grad_rescale: bool = False
    delayed_statistics: bool = True
    fp8_saved_activations: bool = False
    recompute_fp8_weights: bool = False
    keep: Callable[[str], bool] | tuple[str, ...] = DEFAULT_KEEP

    def __post_init__(self):
        for field in ("compute_dtype", "master_dtype", "state_dtype"):
            object.__setattr__(self, field, _dtype(getattr(self, field)))
        for field in ("master_dtype", "state_dtype"):
            dt = getattr(self, field)
            if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
                raise ValueError(f"Recipe {self.name!r}: {field} must be float32, float16 or bfloat16, got {dt}.")
        if self.compute_dtype is not None and not jnp.issubdtype(self.compute_dtype, jnp.floating):
            raise ValueError(f"Recipe {self.name!r}: compute_dtype must be a float dtype, got {self.compute_dtype}.")
        if not (callable(self.keep) or isinstance(self.keep, tuple)):
            raise TypeError(f"Recipe {self.name!r}: keep must be a callable path -> bool or a tuple of "
                            f"module names, got {type(self.keep).__name__}.")
        for field in ("fp8", "norm_grad_rescale", "delayed_statistics", "fp8_saved_activations",
                      "recompute_fp8_weights"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"Recipe {self.name!r}: {field} must be True or False, got {getattr(self, field)!r}.")
        if not isinstance(self.state_min_size, int) or self.state_min_size < 1:
            raise ValueError(f"Recipe {self.name!r}: state_min_size must be an int >= 1, got {self.state_min_size!r}.")

    def keeps(self, path: str) -> bool:
        """Whether the module at `path` ("a/b/c") keeps the model's own precision."""
        if callable(self.keep):
            return bool(self.keep(path))
        return any(part in self.keep for part in path.split("/"))

    def replace(self, **changes) -> "Recipe":
        """This recipe with some fields changed."""
        return dataclasses.replace(self, **changes)

    def train_step(self, loss_fn, optimizer, **kwargs):
        """`scalify.recipes.train_step(self, loss_fn, optimizer, **kwargs)`."""
        from scalify.recipes.train_step import train_step

        return train_step(self, loss_fn, optimizer, **kwargs)


FP32 = Recipe("fp32")
FP16 = Recipe("fp16", compute_dtype=jnp.float16, norm_grad_rescale=True)
FP16_MASTER = FP16.replace(name="fp16-master", master_dtype=jnp.float16)
FP8 = FP16_MASTER.replace(name="fp8", fp8=True)
FP8_FP16_STATE = FP8.replace(name="fp8-fp16-state", state_dtype=jnp.float16)
FP8_BF16 = FP8.replace(name="fp8-bf16", compute_dtype=jnp.bfloat16, norm_grad_rescale=False)

RECIPES = {r.name: r for r in (FP32, FP16, FP16_MASTER, FP8, FP8_FP16_STATE, FP8_BF16)}


def get(name: str) -> Recipe:
    """The recipe called `name` ("fp32", "fp16", "fp16-master", "fp8", "fp8-fp16-state",
    "fp8-bf16"), in any case, with "_" for "-" (the module attribute's name, e.g.
    "FP8_FP16_STATE", works)."""
    key = name.lower().replace("_", "-") if isinstance(name, str) else name
    if key not in RECIPES:
        raise ValueError(f"Unknown recipe {name!r}; choose one of {list(RECIPES)}.")
    return RECIPES[key]
