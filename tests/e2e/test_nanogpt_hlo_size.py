"""Size of the compiled NanoGPT `tiny` fp8 step against the plain step (a compile-time guard).

The recipe path (FP8 dense layers, scalify LayerNorm with its gradient rescale, attention,
the FP16 master update, the optimizer on unscaled float32 values) compiled on CPU, its HLO
instructions counted with `scalify.inspect.hlo_instruction_count` (fused computations
included) against the same step without scalify. A regression guard at today's ratio
(3.26x: the scale arithmetic, the guards' and placements' max-reductions and their scalar
chains), with a margin of about 3% for XLA versions. The goal is 2x.
"""
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from scalify.inspect import hlo_instruction_count

MEASURED_RATIO = 3.26
BOUND = 3.36


def test_tiny_fp8_step_hlo_size_is_bounded():
    pair = S.abstract_step_pair(C.get_recipe("fp8"), "tiny", seq_len=64, batch_size=8)
    scaled = pair.scaled().lower(*pair.args).compile()
    plain = pair.plain().lower(*pair.plain_args).compile()
    n_plain, n_scaled = hlo_instruction_count(plain), hlo_instruction_count(scaled)
    assert n_plain > 1000, n_plain  # the plain step compiled to a real program
    ratio = n_scaled / n_plain
    assert ratio <= BOUND, (
        f"the scalified NanoGPT tiny fp8 step compiles to {n_scaled} HLO instructions, "
        f"{ratio:.2f}x the plain step's {n_plain} (bound {BOUND}x, measured {MEASURED_RATIO}x "
        "when this guard was set): scale arithmetic grew."
    )
