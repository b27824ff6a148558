"""scalify: end-to-end scale propagation for low-precision training in JAX."""
from scalify.core.config import Pow2RoundMode, ScalifyConfig, get_config
from scalify.core.errors import (
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
from scalify.interpreter import (
    interpret_jaxpr,
    register_call_rule,
    register_scale_rule,
    registered_rules,
    scalify,
)

__version__ = "0.1.0"
