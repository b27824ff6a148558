"""scalify.inspect.hlo: reading compiled programs."""
from pathlib import Path

import jax
import jax.numpy as jnp

from scalify.inspect import (count_fp8_gemms, hlo_instruction_count, hlo_op_kinds, hlo_op_sources, peak_temporaries,
                             source_label,
                             xla_memory)

# Instructions of each kind: fusions calling a reduce (one of them also writing its operand),
# a scalar or a larger computation,
# cuBLASLt FP8 and plain GEMM custom calls, a Triton GEMM fusion of float32 operands and
# one of FP8 operands (XLA emits small FP8 GEMMs that way), a transpose.
KINDS = (Path(__file__).resolve().parents[1] / "data" / "hlo" / "kinds.hlo").read_text()
HLO = """HloModule m, entry_computation_layout={(f32[8,4]{1,0})->f32[4,8]{1,0}}

FileLocations
1 {file_name_id=1 function_name_id=1 line=2 end_line=2 column=2 end_column=67}

""" + KINDS


def test_hlo_op_kinds_classifies_each_instruction():
    kinds = hlo_op_kinds(HLO)
    # `u` writes its operand's size and reduces on the side (an optimizer update that takes the
    # new parameters' max): a pass over the data, not a reduction of its own.
    assert kinds == {"amax": "reduce", "u": "elementwise", "s": "scalar", "m": "elementwise", "g": "gemm-fp8",
                     "h": "gemm", "t": "copy", "gemm_fusion_dot.3": "gemm",
                     "gemm_fusion_dot.4": "gemm-fp8"}


def test_count_fp8_gemms():
    assert count_fp8_gemms(HLO) == 2  # the cuBLASLt FP8 call and the FP8 GEMM fusion
    assert count_fp8_gemms(HLO.replace("f8e5m2", "bf16")) == 1  # one FP8 operand only
    assert count_fp8_gemms('custom_call_target="__cublas$gemm"') == 0


def test_hlo_instruction_count_of_text_and_compiled():
    # 3 + 4 + 1 + 1 + 3 + 10 instruction lines; headers, the module line and metadata tables are not.
    assert hlo_instruction_count(HLO) == 22
    assert hlo_instruction_count(HLO.replace("%", "")) == 22  # newer XLA prints no '%'
    x = jnp.ones((4, 8))
    small = jax.jit(lambda x: x + 1).lower(x).compile()
    big = jax.jit(lambda x: jnp.sin(x) * 2 + jnp.sum(x)).lower(x).compile()
    assert hlo_instruction_count(small) == hlo_instruction_count(small.as_text()) >= 2
    assert hlo_instruction_count(big) > hlo_instruction_count(small)


def test_source_label_names_the_pass_and_the_module_path():
    assert source_label("jit(step)/transpose(jvp(Llama))/layers_12/feed_forward/w1/mul") == \
        "backward layers_*/feed_forward/w1"
    assert source_label("jit(step)/jvp(Llama)/lm_head/jit(clip)/min") == "forward lm_head"
    assert source_label("jit(step)/add") == "other -"


def test_hlo_op_sources_of_a_flax_training_step():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(jnp.tanh(nn.Dense(8, name="body")(x)))

    net = Net()
    x = jnp.ones((2, 3))
    params = net.init(jax.random.key(0), x)

    def step(params, x):
        g = jax.grad(lambda p: jnp.sum(net.apply(p, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    compiled = jax.jit(step).lower(params, x).compile()
    labels = set(hlo_op_sources(compiled).values())
    # the forward pass of each module, the backward pass through them, the update outside them
    assert {"forward body", "forward head"} <= labels
    assert any(lab.startswith("backward ") for lab in labels)
    assert hlo_op_sources(compiled) == hlo_op_sources(compiled.as_text())
    # a fusion with no op name of its own takes its computation root's
    text = ('%fused_computation (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n'
            '  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(f)/jvp(M)/dense/mul"}\n}\n\n'
            'ENTRY %main (a: f32[4]) -> f32[4] {\n  %a = f32[4]{0} parameter(0)\n'
            '  ROOT %loop_multiply_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation\n}\n')
    assert hlo_op_sources(text)["loop_multiply_fusion"] == "forward dense"


def test_xla_memory_counts_arguments_outputs_and_temporaries_less_the_donated():
    """A donated (4096,) float32 argument aliased to the output: the program's memory is
    its arguments plus its outputs less the aliased bytes plus temporaries, and the
    arguments are the bytes passed in."""
    x = jnp.ones((4096,), jnp.float32)
    compiled = jax.jit(lambda a, b: (a * 2.0 + b, jnp.sum(b)), donate_argnums=0).lower(x, x).compile()
    m = xla_memory(compiled)
    assert m["argument_size_in_bytes"] == 2 * 4096 * 4
    assert m["bytes"] == (m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
                          + m["temp_size_in_bytes"])
    assert m["alias_size_in_bytes"] in (0, 4096 * 4)  # whether the backend aliases the donation


def test_xla_memory_of_a_program_without_the_analysis_says_why():
    class NoAnalysis:
        def memory_analysis(self):
            raise NotImplementedError("this backend has no memory analysis")

    assert xla_memory(NoAnalysis()) == {"unavailable": "this backend has no memory analysis"}


# A scheduled entry computation: `a` (4 kB) and `b` (8 kB) live together; the custom call
# writes a result (2 kB) and a workspace nobody reads (100 B); `d` is written over `g`'s
# buffer (same size, dying there); `r` and `o` are the program's outputs.
PEAK = """HloModule peak, is_scheduled=true

ENTRY %main (p: f32[4]) -> (f32[4], f32[512]) {
  %p = f32[4]{0} parameter(0)
  %a = f32[1024]{0} fusion(%p), kind=kLoop, calls=%c1, metadata={op_name="jit(step)/jvp(M)/dense/mul"}
  %b = f32[2048]{0} fusion(%a), kind=kLoop, calls=%c2, metadata={op_name="jit(step)/jvp(M)/dense/tanh"}
  %t = (f32[512]{0}, s8[100]{0}) custom-call(%b), custom_call_target="x", metadata={op_name="jit(step)/transpose(jvp(M))/dense/dot_general"}
  %g = f32[512]{0} get-tuple-element(%t), index=0
  %c = f32[512]{0} bitcast(%g)
  %d = f32[512]{0} fusion(%c, %b), kind=kLoop, calls=%c3
  %o = f32[512]{0} fusion(%d), kind=kLoop, calls=%c4
  %r = f32[4]{0} fusion(%d), kind=kLoop, calls=%c5
  ROOT %out = (f32[4]{0}, f32[512]{0}) tuple(%r, %o)
}
"""


def test_peak_temporaries_replays_the_schedule():
    peak = peak_temporaries(PEAK)
    assert (peak.bytes, peak.at) == (4096 + 8192, "b")
    assert peak.live == (("forward dense", "f32[2048]", 1, 8192), ("forward dense", "f32[1024]", 1, 4096))
    # Without `a`, the peak moves to the custom call: `b`, its result and its workspace.
    later = peak_temporaries(PEAK.replace("f32[1024]{0} fusion", "f32[1]{0} fusion"))
    assert (later.bytes, later.at) == (8192 + 2048 + 100, "t")
    assert peak_temporaries(PEAK, min_bytes=5000).live == (("forward dense", "f32[2048]", 1, 8192),)


def test_peak_temporaries_holds_each_element_of_a_tuple_to_its_own_last_reader():
    """A multi-output fusion's elements are buffers of their own: `m`'s 4 kB element dies at
    `x`, its first reader, not at the `get-tuple-element` of its other element, late."""
    tuple_module = """HloModule tuple, is_scheduled=true

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %m = (f32[1024]{0}, f32[2]{0}) fusion(%p), kind=kInput, calls=%c1
  %g0 = f32[1024]{0} get-tuple-element(%m), index=0
  %x = f32[4]{0} fusion(%g0), kind=kLoop, calls=%c2
  %b = f32[2048]{0} fusion(%x), kind=kLoop, calls=%c3
  %g1 = f32[2]{0} get-tuple-element(%m), index=1
  ROOT %y = f32[4]{0} fusion(%b, %g1), kind=kLoop, calls=%c4
}
"""
    peak = peak_temporaries(tuple_module)
    assert (peak.bytes, peak.at) == (8 + 16 + 8192, "b")


def test_peak_temporaries_keeps_a_computed_value_out_of_a_donated_argument():
    """An output aliased to a donated argument (`input_output_alias`) is written into the
    argument's buffer: the computed value it is written over (`g`, a gradient) is a
    temporary until then. XLA's copy of the argument itself (`copy(p)`) is not: the
    output takes its place."""
    module = """HloModule alias, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }

ENTRY %main (p: f32[1024], x: f32[4]) -> (f32[1024], f32[4]) {
  %p = f32[1024]{0} parameter(0)
  %x = f32[4]{0} parameter(1)
  %g = f32[1024]{0} fusion(%x), kind=kLoop, calls=%c1
  %a = f32[2048]{0} fusion(%g), kind=kLoop, calls=%c2
  %y = f32[4]{0} fusion(%a), kind=kLoop, calls=%c3
  %o = f32[1024]{0} fusion(%p, %g), kind=kLoop, calls=%c4
  ROOT %out = (f32[1024]{0}, f32[4]{0}) tuple(%o, %y)
}
"""
    assert (peak_temporaries(module).bytes, peak_temporaries(module).at) == (4096 + 8192, "a")
    copied = module.replace("fusion(%x), kind=kLoop, calls=%c1", "copy(%p)")
    assert peak_temporaries(copied).bytes == 8192


def test_peak_temporaries_of_a_compiled_step_holds_the_forward_activations():
    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.sum(h * h)
        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

    ws = [jnp.full((128, 128), 0.01) for _ in range(4)]
    compiled = jax.jit(step, donate_argnums=0).lower(ws, jnp.ones((256, 128))).compile()
    peak = peak_temporaries(compiled)
    assert sum(n for *_, n in peak.live) == peak.bytes
    # XLA packs the same buffers into its temporary allocation: 10% leaves room for the
    # packing, where a wrong liveness (e.g. a buffer kept past its last reader) is far off.
    assert abs(peak.bytes - xla_memory(compiled)["temp_size_in_bytes"]) <= 0.1 * peak.bytes
    assert f"%{peak.at} = " in compiled.as_text()
    # The backward pass starts with the forward's activations (tanh outputs) live.
    forward = sum(c for source, kind, c, _ in peak.live if source.startswith("forward") and kind == "f32[256,128]")
    assert forward >= 3


def test_hlo_op_sources_reads_an_entry_header_with_index_comments():
    """A long tuple type in the ENTRY header carries `/*index=5*/` comments: the header is
    still a computation's, so the entry's op names do not label the fused computation
    printed before it."""
    hlo = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: f32[4]) -> (f32[4], f32[], f32[], f32[], f32[], /*index=5*/f32[]) {
  %a = f32[4]{0} parameter(0), metadata={op_name="jit(step)/jvp(M)/dense/mul"}
  ROOT %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused
}
"""
    sources = hlo_op_sources(hlo)
    assert sources == {"a": "forward dense"}
    assert peak_temporaries(hlo).bytes == 0  # the fusion writes the output
