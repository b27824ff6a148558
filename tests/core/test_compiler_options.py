"""`scalify.compiler_options()`: XLA options for compiling a scalified program."""
import jax
import jax.numpy as jnp
import numpy as np

import scalify
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S


def test_options_compile_and_keep_values():
    """The installed XLA knows every option (an unknown one fails the compile) and the
    compiled program computes the same values."""
    def f(w, x):
        return jnp.tanh(x @ w).sum()

    w = scalify.as_scaled_array(jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(4, 3))
    x = jnp.ones((2, 4), jnp.float32)
    default = jax.jit(scalify.scalify(jax.grad(f)))(w, x)
    tuned = jax.jit(scalify.scalify(jax.grad(f)), compiler_options=scalify.compiler_options())(w, x)
    np.testing.assert_array_equal(np.asarray(tuned), np.asarray(default))


def test_options_are_a_fresh_dict():
    opts = scalify.compiler_options()
    opts["xla_gpu_enable_triton_gemm"] = True
    assert scalify.compiler_options() == {"xla_gpu_enable_triton_gemm": False, "xla_allow_excess_precision": False}


def test_nanogpt_scalified_steps_use_them_plain_steps_do_not():
    assert S.compiler_options(C.get_recipe("fp8")) == scalify.compiler_options()
    assert S.compiler_options(C.get_recipe("fp8"), use_scalify=False) == {}
    assert S.compiler_options(C.get_recipe("bf16")) == {}
