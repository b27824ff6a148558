"""scalify: end-to-end scale propagation for low-precision training in JAX."""
from scalify.core.compiler_options import compiler_options
from scalify.core.config import Pow2RoundMode, ScalifyConfig, get_config
from scalify.core.errors import (
    OuterTransformError,
    ScaledTypeError,
    ScaleError,
    ScalifyError,
    UnsupportedPrimitiveError,
)
from scalify.core.pow2 import (
    is_pow2,
    pow2_round,
    pow2_round_down,
    pow2_round_nearest,
    pow2_round_up,
    split_pow2,
)
from scalify.core.scaled_array import (
    ScaledArray,
    as_scaled_array,
    asarray,
    is_scaled_leaf,
    scaled_array,
)
from scalify.quant.e8m0 import E8M0
from scalify.quant.e8m0 import from_e8m0 as scale_from_e8m0
from scalify.quant.e8m0 import to_e8m0 as scale_to_e8m0
from scalify.core.registry import register_call_rule, register_scale_rule, registered_rules
from scalify.interpreter import interpret_jaxpr, scalify

# Importing the rule packages registers the built-in scale rules (scalify/rules: lax
# primitives; scalify/ops: the scaling ops' primitives) in scalify.core.registry.
from scalify import rules, ops
from scalify import inspect, nn, optim, quant, recipes
from scalify.ops import (
    DelayedScalingState,
    cast,
    cast_on_backward,
    cast_on_forward,
    custom_scale,
    delayed_rescale,
    delayed_scaling_init,
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
    get_data_scale,
    rebalance,
    reduce_precision,
    reduce_precision_on_backward,
    reduce_precision_on_forward,
    set_scaling,
    stop_scaling,
)
from scalify.ops.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    JitScaling,
    StaticScaling,
    fp8_dot_general,
    mx_dequantize_scaled,
    mx_quantize_scaled,
    scaling_policy,
)
from scalify.ops.saved_activations import (
    ResidualPolicy,
    SaveSpec,
    dequantize_saved,
    fp8_saved_attention,
    fp8_saved_dense,
    fp8_saved_gelu,
    fp8_saved_layer_norm,
    fp8_saved_module_call,
    quantize_saved,
    save_in_fp8,
)
from scalify import distributed, inspect
from scalify.distributed import scaled_pmean, scaled_psum, scaled_psum_scatter
from scalify.rules.linalg import (
    contraction_scale_factor,
    scaled_conv_general_dilated,
    scaled_dot_general,
)

__version__ = "0.1.0"
