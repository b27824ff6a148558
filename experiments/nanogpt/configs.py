"""Precision recipes of the NanoGPT example: the five configurations of the Scalify paper's
Table 3 (Balança et al. 2024) and two baselines without scalify.

A recipe is data (a frozen dataclass); `experiments/nanogpt/step.py` turns it into a model,
an optimizer and an update function. Dtypes are names (JSON-friendly; see `DTYPES`).

========================  ====  =========================================================
name                      #     what it does
========================  ====  =========================================================
``fp32``                  #0    scalify, float32 everywhere (scales propagated, data fp32;
                                the master weights re-scaled to unit max-abs after each
                                update)
``fp16``                  #1    scalify, FP16 activations and matmuls (inputs, kernels,
                                gradients), FP32 master weights (re-scaled as in #0) and
                                Adam state (the optimizer on unscaled float32 values,
                                ``unscaled_optimizer``); LayerNorm backward (input-gradient)
                                dynamic rescale; the tied output head in bfloat16 (as bf16's)
``fp16-master``           #2    #1 + FP16 scaled master weights
``fp8``                   #3    #2 with FP8 matmuls: E4M3 inputs and kernels, E5M2 output
                                gradients (FP16 outputs); FP16 master weights; kernels
                                stored (out, in) (``kernel_layout``)
``fp8-fp16-state``        #4    #3 + Adam state stored as scaled FP16 (tensors of 4096
                                elements or more, ``state_min_size``; AdamW on its
                                float32 values, ``unscaled_optimizer``; the paper's
                                gradient rescale before the optimizer changes no value
                                then and is left out)
``fp8-bf16``              -     #3 with bfloat16 activations and matmul outputs and no
                                LayerNorm gradient rescale (``scalify.recipes.FP8_BF16``)
``bf16``                  -     plain JAX/Flax: bfloat16 compute, float32 params and state
``flax-fp8``              -     plain Flax: bfloat16 compute, matmuls through
                                ``flax.linen.Fp8DirectDotGeneralOp`` (delayed scaling)
``fp32-plain``            -     plain JAX/Flax float32 (reference for "scalify costs
                                nothing": the same step as ``fp32`` without the transform)
========================  ====  =========================================================

All scalify recipes transform the whole step (forward, backward, optimizer update) with
``scalify.scalify(update_fn)``, the paper's Algorithm 1; the parameters are converted once
to ``ScaledArray`` (``scalify.as_scaled_array``, or ``scalify.optim.scaled_params`` for
FP16 master weights).

Matmul scaling is scalify's static propagation ("static" policy of ``scalify.nn.Dense``):
unit-scaling rules keep the data near 1, the FP8/FP16 cast applies to the data and the
scale stays in float32. The FP16 master weights are unit-scaled (``scaled_params`` with its
default ``margin=None``): each tensor's power-of-two scale puts its largest weight in
``(1, 2]`` of data, where scalify's unit-scaling rules assume the data is (and inside
E4M3's range, so the kernel is cast to E4M3 statically). A margin below the format's
emax inflates the data of every product with the weights (static scales do not correct
it): with ``master_margin=13`` the LayerNorm gains (all ~1) have data ~4, the largest
FP16 data in the attention backward is ~40x that of unit-scale masters, and the backward
``d_logits @ k`` matmul of the tiny model overflows FP16 at step 10 (inf gradients, then
NaN parameters through the global-norm clipping).

Recipes #1-#4 train on the library's step, `scalify.recipes.train_step` (`step.py`'s
`library_recipe`): AdamW on unscaled float32 values (``unscaled_optimizer``; #4's moments
stored as scaled FP16), the gradients of 16-bit masters taken at their float32 view
(``param_grads_f32``). #0 keeps the whole step scaled, its optimizer included, as the
reference that scale propagation changes no value; `step.py` builds its step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from experiments.nanogpt.model import ATTENTIONS

__all__ = [
    "Recipe",
    "RECIPES",
    "PAPER_CONFIGS",
    "BASELINES",
    "ALL_CONFIGS",
    "DTYPES",
    "resolve_dtype",
    "get_recipe",
    "parse_overrides",
]

# Dtype names accepted in recipes.
DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "e4m3": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
}


def resolve_dtype(name: str | None):
    """The jnp dtype of a recipe dtype name (None stays None)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype name {name!r}; use one of {sorted(DTYPES)}.")
    return jnp.dtype(DTYPES[name])


PARAM_RESCALES = (None, "l2", "max", "previous")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A precision configuration of the training step.

    Attributes:
      name: the ``--config`` name.
      paper: the row of the Scalify paper's Table 3 ("#0".."#4") or "" for baselines.
      description: one line for logs, tables and plots.
      scalify: transform the whole update step with ``scalify.scalify``.
      dtype: compute dtype of the model's layers (activations).
      matmul_input, matmul_kernel, matmul_grad: formats of the input, the kernel and the
        output gradient in every linear layer (None: the compute dtype, plain matmul).
      matmul_output: dtype of the linear layers' matmul output (None: ``dtype``).
      head_matmul: run the tied output head (``embed.attend``) with the same matmul formats
        as the linear layers (default: the head stays in the compute dtype).
      head_grad, head_output: with ``head_matmul``, the head's output-gradient format and
        logits dtype, in place of ``matmul_grad`` and ``matmul_output`` (None: theirs).
        "bfloat16" for both keeps the head's logits and its two backward GEMMs in bfloat16
        (float32's exponent range: no float16 rescale of the 50k-wide logits, no FP8
        transpose of their gradient) while its forward GEMM runs on E4M3 operands.
      head_dtype: dtype of the tied output head's operands and logits (None: the compute
        dtype). The scalified FP16/FP8 recipes use "bfloat16", as the plain bf16 baseline
        does: float16 logits (batch x seq x 50k) would be accumulated in float32, reduced
        for their max-abs and cast (`ScalifyConfig.narrow_dot_rescale`), about 5 GB of
        extra memory traffic per step on the `paper` model; bfloat16 has float32's exponent
        range and needs no rescale.
      master: storage dtype of the parameters (master weights); a 16-bit master is a
        scaled array (``scalify.optim.scaled_params``).
      master_margin: binades of headroom below the master format's max; None (default):
        unit-scale master weights, largest weight in (1, 2] of data (see module doc).
      master_rounding: "nearest" or "stochastic" rounding of the master-weight update.
      master_scale: where a 16-bit master's new power-of-two scale comes from
        (``scalify.optim.apply_updates(scale_from=...)``): "new", the updated weights'
        max-abs (the float32 update is written, reduced, then encoded), or "previous", the
        max-abs of the weights before the update (known before the update is computed, so
        the update and its FP16 encode are one pass).
      param_rescale: rescale of the updated float32 master weights (None, "l2", "max",
        "previous"; the initial weights get the same norm, "max" for "previous"): without it the scale of `p + u`
        follows the unit-scaling rule of `add`, whose estimate is dominated by the scale of
        the AdamW update (not its size), and the weights' data drifts far below 1 over
        training (FP16 casts of it then lose bits). 16-bit masters get a fresh scale at
        every update anyway (`scalify.optim`). "max" and "previous" give the
        normalisation of the unit-scale FP16 masters of #2-#4 (`scaled_params`: largest
        weight at data 1-2): with "l2" (unit RMS) a trained weight's largest entries have
        data ~10 and more (up to sqrt(fan) for a weight whose energy sits in a few
        entries), the matmul outputs on them sit that much above the unit-scaling estimate,
        and in attention two such factors meet: the raw FP16 ``q @ k`` product of #1 can
        overflow to inf, and the softmax's ``logits - max`` makes it NaN
        (`tests/e2e/test_nanogpt_fp16_overflow.py`). Unit max-abs masters keep each activation's data
        ~5x lower (the attention logits' ~25x), like #2-#4, which do not overflow. Float32
        data is exact at any power-of-two scale, so for #0 the choice changes nothing but
        keeps #0 and #1 the same recipe up to the dtypes. "l2" and "max" are dynamic
        rescales of the new weights (`dynamic_rescale_*`: the new value is written,
        reduced, then rewritten at its new scale); "previous" (#0 and #1) takes the
        power of two of the largest weight *before* the update
        (`scalify.optim.apply_updates(float32_scale_from="previous")`), so the update
        writes the new data at their new scale in its own pass: the same placement as
        "max" up to the update's growth of the largest weight.
      param_grads_f32: for 16-bit master weights, differentiate with respect to a float32
        view of them, so the parameter gradients have float32 data (a weight gradient sums
        correlated contributions over all tokens: its data can exceed the unit-scaling
        estimate and overflow float16). Activations and their gradients are unaffected.
      state: storage of the optimizer state (None: float32; "float16": scaled FP16 via
        ``scalify.optim.scaled_state``).
      state_min_size: with ``state``, leaves of fewer elements keep a float32 state
        (``scaled_state(min_size=...)``; 4096, bitsandbytes' threshold). Each stored leaf
        is encoded with a max-reduction per moment and step; the small ones (biases,
        LayerNorm parameters: 0.05% of `paper`'s parameters, 58 of its 100 leaves) would
        cost those kernels for no memory.
      unscaled_optimizer: run the optimizer (global-norm clipping, AdamW) on unscaled
        float32 values (``scalify.optim.unscaled``): gradients and params enter it as
        ``data * scale``, its state is plain float32, and only the master-weight update
        carries scales. The same values as the scaled optimizer (power-of-two scales are
        exact in float32) without its scale arithmetic and guards: the input guard's
        max-reduction over every Adam moment at each step and the power guard before
        ``g * g``. With a low-precision ``state`` the moments are stored scaled as
        before and decoded to plain float32 values for the update
        (``scaled_state(..., unscaled_values=True)``).
      ln_grad_rescale: dynamic rescale of the LayerNorm input gradient (None, "l2", "max").
      grad_rescale: dynamic rescale of each gradient before the optimizer (None, "l2", "max").
      flax_fp8: plain Flax FP8 baseline: "direct" (``Fp8DirectDotGeneralOp``) or "qdq"
        (``Fp8DotGeneralOp``, quantise-dequantise) as ``dot_general_cls`` of ``nn.Dense``.
      fp8_history: amax history length of the Flax FP8 ops.
      attention: the model's attention (``GPTConfig.attention``: "auto", "softmax", "xla",
        "cudnn"); None (default): the model's own ("auto": cuDNN flash attention on a GPU
        for 16-bit models, else softmax). ``--attention`` of train.py/bench.py overrides it.
      kernel_layout: shape of the linear layers' kernels, "in_out" (flax's ``(in, out)``) or
        "out_in" (``(out, in)``, see ``scalify.nn.Dense``); same math, the FP8 weight
        gradients then need no transposes on Hopper. Plain recipes build ``nn.Dense`` for
        "in_out" and ``scalify.nn.Dense`` with no low-precision role (the same layer) for
        "out_in"; the Flax fp8_ops baseline has only "in_out".
      scalify_config: `scalify.ScalifyConfig` fields for the scalified step, as
        ``FIELD=VALUE+FIELD=VALUE`` (e.g. ``narrow_dot_accumulator=bfloat16+cast_drift_window=none``;
        in a config name: ``fp8:scalify_config=narrow_dot_accumulator=bfloat16``); None: the
        defaults.
    """

    name: str
    paper: str = ""
    description: str = ""
    scalify: bool = True
    dtype: str = "float32"
    matmul_input: str | None = None
    matmul_kernel: str | None = None
    matmul_grad: str | None = None
    matmul_output: str | None = None
    head_matmul: bool = False
    head_grad: str | None = None
    head_output: str | None = None
    head_dtype: str | None = None
    master: str = "float32"
    master_margin: int | None = None
    master_rounding: str = "nearest"
    master_scale: str = "new"
    param_rescale: str | None = None
    param_grads_f32: bool = True
    state: str | None = None
    state_min_size: int = 4096
    unscaled_optimizer: bool = False
    ln_grad_rescale: str | None = None
    grad_rescale: str | None = None
    flax_fp8: str | None = None
    fp8_history: int = 1024
    kernel_layout: str = "in_out"
    scalify_config: str | None = None
    attention: str | None = None

    def __post_init__(self):
        for f in ("dtype", "matmul_input", "matmul_kernel", "matmul_grad", "matmul_output", "head_grad", "head_output",
                  "head_dtype", "master",
                  "state"):
            resolve_dtype(getattr(self, f))
        if self.flax_fp8 not in (None, "direct", "qdq"):
            raise ValueError(f"flax_fp8 must be None, 'direct' or 'qdq', got {self.flax_fp8!r}.")
        if self.flax_fp8 and self.scalify:
            raise ValueError("The Flax fp8_ops baseline runs without scalify (scalify=False).")
        if not self.scalify and (self.master != "float32" or self.state or self.grad_rescale
                                 or self.ln_grad_rescale or self.low_precision_matmul):
            raise ValueError(
                f"Recipe {self.name!r}: scaled master weights, scaled state, rescales and "
                "scalify matmul formats need scalify=True."
            )
        from scalify.nn.dense import KERNEL_LAYOUTS

        if self.kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(f"kernel_layout must be one of {KERNEL_LAYOUTS}, got {self.kernel_layout!r}.")
        if self.head_dtype is not None and self.head_matmul:
            raise ValueError("head_dtype and head_matmul both set the output head's matmul; use one.")
        if (self.head_grad or self.head_output) and not self.head_matmul:
            raise ValueError("head_grad and head_output set the formats of the low-precision head: "
                             "they need head_matmul=true (and head_dtype=none).")
        if self.scalify_config is not None:
            if not self.scalify:
                raise ValueError("scalify_config applies to scalify recipes (scalify=True).")
            self.make_scalify_config()  # fail early on a typo
        if self.unscaled_optimizer and not self.scalify:
            raise ValueError(f"Recipe {self.name!r}: unscaled_optimizer runs the optimizer of a scalify "
                             "recipe on float32 values; it needs scalify=True.")
        if self.flax_fp8 and self.kernel_layout != "in_out":
            raise ValueError("The Flax fp8_ops baseline (nn.Dense) has only kernel_layout='in_out'.")
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be None or one of {ATTENTIONS}, got {self.attention!r}.")
        if not isinstance(self.state_min_size, int) or self.state_min_size < 1:
            raise ValueError(f"state_min_size must be an int >= 1, got {self.state_min_size!r}.")
        if self.param_rescale not in PARAM_RESCALES:
            raise ValueError(f"param_rescale must be one of {PARAM_RESCALES}, got {self.param_rescale!r}.")
        if self.param_rescale is not None and self.scaled_master:
            raise ValueError(f"Recipe {self.name!r}: param_rescale applies to float32 master weights; "
                             f"{self.master} masters get their scale from `master_scale`.")
        if self.master_scale not in ("new", "previous"):
            raise ValueError(f"master_scale must be 'new' or 'previous', got {self.master_scale!r}.")
        if self.master_rounding not in ("nearest", "stochastic"):
            raise ValueError(f"master_rounding must be 'nearest' or 'stochastic', got {self.master_rounding!r}.")

    def make_scalify_config(self):
        """The `scalify.ScalifyConfig` of ``scalify_config`` (None when unset)."""
        if self.scalify_config is None:
            return None
        import scalify

        fields = {f.name: f for f in dataclasses.fields(scalify.ScalifyConfig)}
        kwargs = {}
        for item in str(self.scalify_config).split("+"):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in fields:
                raise ValueError(f"scalify_config item {item!r}: expected FIELD=VALUE with FIELD one of "
                                 f"{sorted(fields)}.")
            value = value.strip()
            # "none" is None only for fields that take None (it is a fp8_operand_layout value)
            keep_text = value.lower() == "none" and "None" not in str(fields[key].type)
            kwargs[key] = value if keep_text else _parse_value(value)
        return scalify.ScalifyConfig(**kwargs)

    @property
    def low_precision_matmul(self) -> bool:
        return any(d is not None for d in (self.matmul_input, self.matmul_kernel, self.matmul_grad))

    @property
    def scaled_master(self) -> bool:
        return self.scalify and resolve_dtype(self.master).itemsize < 4

    def replace(self, **overrides) -> "Recipe":
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FP16_MM = dict(dtype="float16", matmul_input="float16", matmul_kernel="float16", matmul_grad="float16",
                head_dtype="bfloat16")
# FP8 recipes store their kernels (out, in): cuBLASLt's FP8 GEMM writes the weight gradient
# out-major, so with (in, out) kernels XLA transposes every float32 optimizer tensor of each
# kernel on Hopper.
_FP8_MM = dict(dtype="float16", matmul_input="e4m3", matmul_kernel="e4m3", matmul_grad="e5m2",
               matmul_output="float16", head_dtype="bfloat16", kernel_layout="out_in")
# Unit-scale master weights (module doc), each update encoded with the scale of the weights
# before it (`master_scale`): XLA fuses AdamW's update and the FP16 encode into one pass.
_FP16_MASTER = dict(master="float16", master_scale="previous")
# Recipes #1-#3 keep a float32 Adam state: the optimizer runs on unscaled float32 values
# (`scalify.optim.unscaled`), the same numbers without scale arithmetic or guards over the
# state. #4 does
# too, its FP16 moments decoded to float32 values for the update (`scaled_state(...,
# unscaled_values=True)`). The paper's #4 also rescales each gradient before the optimizer;
# here the gradients reach AdamW as float32 values, so that rescale changes no value and is
# left out (one max-reduction per gradient, and the scale arithmetic of the scaled
# optimizer).
_F32_STATE = dict(unscaled_optimizer=True)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("fp32", "#0", "scalify FP32: float32 data, propagated scales", param_rescale="previous"),
        Recipe("fp16", "#1", "scalify FP16 matmuls, FP32 master weights and state, LayerNorm grad rescale",
               **_FP16_MM, **_F32_STATE, param_rescale="previous", ln_grad_rescale="l2"),
        Recipe("fp16-master", "#2", "scalify FP16 matmuls + FP16 master, LayerNorm grad rescale",
               **_FP16_MM, **_FP16_MASTER, **_F32_STATE, ln_grad_rescale="l2"),
        Recipe("fp8", "#3", "scalify FP8 matmuls (E4M3 fwd, E5M2 grads), FP16 master",
               **_FP8_MM, **_FP16_MASTER, **_F32_STATE, ln_grad_rescale="l2"),
        Recipe("fp8-fp16-state", "#4", "scalify FP8 matmuls, FP16 master and Adam state",
               **_FP8_MM, **_FP16_MASTER, ln_grad_rescale="l2", state="float16", unscaled_optimizer=True),
        Recipe("fp8-bf16", "", "scalify FP8 matmuls, bfloat16 activations, FP16 master",
               **{**_FP8_MM, "dtype": "bfloat16", "matmul_output": "bfloat16"}, **_FP16_MASTER, **_F32_STATE),
        Recipe("bf16", "", "plain Flax bfloat16 compute, float32 params and state",
               scalify=False, dtype="bfloat16"),
        Recipe("flax-fp8", "", "plain Flax fp8_ops delayed scaling (Fp8DirectDotGeneralOp), bf16",
               scalify=False, dtype="bfloat16", flax_fp8="direct"),
        Recipe("fp32-plain", "", "plain Flax float32 (fp32 without scalify)", scalify=False),
        Recipe("bf16-flash", "", "plain Flax bfloat16 compute with cuDNN flash attention (GPU)",
               scalify=False, dtype="bfloat16", attention="cudnn"),
    ]
}

PAPER_CONFIGS = ("fp32", "fp16", "fp16-master", "fp8", "fp8-fp16-state")
BASELINES = ("bf16", "flax-fp8")
# What `--configs all` means: the paper's five and the two baselines.
ALL_CONFIGS = PAPER_CONFIGS + BASELINES


def _parse_value(text: str):
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def parse_overrides(items: list[str] | None) -> dict:
    """``["key=value", ...]`` (the ``--set`` option) -> a dict of Recipe field overrides."""
    out = {}
    fields = {f.name for f in dataclasses.fields(Recipe)}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}.")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if key not in fields or key == "name":
            raise ValueError(f"Unknown recipe field {key!r}; one of {sorted(fields - {'name'})}.")
        out[key] = _parse_value(value.strip())
    return out


def get_recipe(name: str, **overrides) -> Recipe:
    """The recipe ``name`` with field ``overrides`` applied.

    ``name`` may carry its own overrides, ``NAME:FIELD=VALUE[:FIELD=VALUE...]`` (e.g.
    ``fp8:kernel_layout=in_out``), so that variants of one recipe can be compared in one run;
    the variant keeps that full name. Explicit ``overrides`` apply after them.
    """
    if ":" in name:
        base, *items = name.split(":")
        inline = parse_overrides(items)
        return get_recipe(base, **{**inline, **overrides}).replace(name=name)
    if name not in RECIPES:
        raise ValueError(f"Unknown config {name!r}; choose one of {list(RECIPES)}.")
    recipe = RECIPES[name]
    return recipe.replace(**overrides) if overrides else recipe
