"""Low-precision number formats on plain arrays: FP8 format info and saturating casts,
E8M0 scales, MX block scaling, 8-bit block-wise dynamic quantisation (bitsandbytes) and
COAT per-group FP8 with dynamic range expansion. No ScaledArray dependency."""

from scalify.quant.blockwise import (
    blockwise_dequantize,
    blockwise_quantize,
    dynamic_dequantize,
    dynamic_map,
    dynamic_quantize,
    linear_dequantize,
    linear_map,
    linear_quantize,
    quantize_to_codebook,
)
from scalify.quant.coat import (
    coat_dequantize,
    coat_expansion_exponent,
    coat_quantize,
    default_target_range,
)
from scalify.quant.e8m0 import E8M0, e8m0_exponent, from_e8m0, to_e8m0
from scalify.quant.formats import (
    SUPPORTED_FORMATS,
    FormatInfo,
    format_info,
    is_fp8,
    saturating_cast,
    widen,
)
from scalify.quant.mx import floor_log2, mx_dequantize, mx_quantize

__all__ = [
    "FormatInfo",
    "format_info",
    "saturating_cast",
    "widen",
    "is_fp8",
    "SUPPORTED_FORMATS",
    "E8M0",
    "to_e8m0",
    "from_e8m0",
    "e8m0_exponent",
    "floor_log2",
    "mx_quantize",
    "mx_dequantize",
    "dynamic_map",
    "linear_map",
    "quantize_to_codebook",
    "blockwise_quantize",
    "blockwise_dequantize",
    "linear_quantize",
    "linear_dequantize",
    "dynamic_quantize",
    "dynamic_dequantize",
    "coat_quantize",
    "coat_dequantize",
    "coat_expansion_exponent",
    "default_target_range",
]
