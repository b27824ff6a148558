"""Ops users call inside models: valid with or without scalify.

Outside `scalify` each op is the identity or plain math, so a model that uses them runs
unchanged without the transform; inside, each acts on the scale of its input.
"""
from scalify.ops import fp8  # noqa: F401  (registers the FP8 ops' scale rules)
from scalify.ops import saved_activations  # noqa: F401
from scalify.ops.activations import gelu, relu, silu
from scalify.ops.casts import (
    cast,
    cast_on_backward,
    cast_on_forward,
    reduce_precision,
    reduce_precision_on_backward,
    reduce_precision_on_forward,
)
from scalify.ops.custom_scale import custom_scale, custom_scale_call_p
from scalify.ops.rescale import (
    DelayedScalingState,
    delayed_rescale,
    delayed_scaling_init,
    dynamic_rescale_grad_p,
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
    dynamic_rescale_p,
    unit_rescale,
)
from scalify.ops.scaling import (
    as_scaled_value,
    as_scaled_value_p,
    get_data_scale,
    get_data_scale_p,
    rebalance,
    rebalance_p,
    set_scaling,
    set_scaling_p,
    stop_scaling,
    stop_scaling_p,
)

__all__ = [
    "set_scaling",
    "get_data_scale",
    "stop_scaling",
    "as_scaled_value",
    "rebalance",
    "dynamic_rescale_l1",
    "dynamic_rescale_l2",
    "dynamic_rescale_max",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max_grad",
    "unit_rescale",
    "DelayedScalingState",
    "delayed_scaling_init",
    "delayed_rescale",
    "custom_scale",
    "cast",
    "cast_on_forward",
    "cast_on_backward",
    "reduce_precision",
    "reduce_precision_on_forward",
    "reduce_precision_on_backward",
    "fp8",
    "relu",
    "gelu",
    "silu",
    "set_scaling_p",
    "get_data_scale_p",
    "stop_scaling_p",
    "as_scaled_value_p",
    "rebalance_p",
    "dynamic_rescale_p",
    "dynamic_rescale_grad_p",
    "custom_scale_call_p",
]
