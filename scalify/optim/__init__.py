"""Low-precision optimizer state and master weights, optax-compatible.

- `scaled_state(inner, dtype)`: any optax transformation with its state stored as
  scaled FP16 (or FP8, BF16) `ScaledArray`s; `quantized_state(inner, codec)` in general.
- `scaled_params` / `apply_updates`: FP16 scaled master weights, round-to-nearest or
  stochastic rounding.
- Variants: `adamw_fp8lm` (FP8-LM / MS-AMP), `adamw_8bit` (bitsandbytes block-wise),
  `adamw_coat` (COAT), and the `StableEmbedding` layer of the 8-bit paper.
- Diagnostics: `bytes_per_parameter`, `quantization_error`, `dequantize_state`.

See docs/optimizers.md.
"""
from scalify.optim.codecs import (
    BlockwiseArray,
    BlockwiseCodec,
    CoatArray,
    CoatCodec,
    ScaledCodec,
    is_stored_leaf,
    round_to_dtype,
    scale_for,
)
from scalify.optim.diagnostics import (
    QuantizationError,
    bytes_per_parameter,
    dequantize_state,
    parameter_count,
    quantization_error,
    tree_nbytes,
)
from scalify.optim.layers import StableEmbedding
from scalify.optim.master import apply_updates, scaled_params
from scalify.optim.variants import adamw_8bit, adamw_coat, adamw_fp8lm
from scalify.optim.wrappers import (
    QuantizedState,
    moment_codecs,
    quantized_state,
    scaled_state,
    unscaled,
    values,
)

__all__ = [
    "scaled_state",
    "quantized_state",
    "QuantizedState",
    "moment_codecs",
    "values",
    "unscaled",
    "ScaledCodec",
    "BlockwiseCodec",
    "CoatCodec",
    "BlockwiseArray",
    "CoatArray",
    "is_stored_leaf",
    "scale_for",
    "round_to_dtype",
    "scaled_params",
    "apply_updates",
    "adamw_fp8lm",
    "adamw_8bit",
    "adamw_coat",
    "StableEmbedding",
    "bytes_per_parameter",
    "parameter_count",
    "tree_nbytes",
    "dequantize_state",
    "quantization_error",
    "QuantizationError",
]
