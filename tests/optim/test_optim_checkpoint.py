"""Orbax checkpoint of scaled optimizer state and FP16 scaled master weights: restores bit
for bit, and a resumed run continues with the identical loss sequence."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import optim_problem as P
import scalify.optim as so
from scalify import ScaledArray


def _bits(x):
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _save_restore(tree, path):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    return restored


def test_checkpoint_restores_bit_exact_and_resumes_identically(tmp_path):
    """FP8-LM state (ScaledArray of E4M3 and FP16) + FP16 scaled master weights with
    stochastic rounding (the PRNG key is checkpointed too)."""
    tx = so.adamw_fp8lm(P.LR)
    steps = 25
    (params, state, key), _ = P.run(tx, steps=steps, master_dtype=jnp.float16, rounding="stochastic")
    assert isinstance(params["l1"]["w"], ScaledArray)
    dtypes = {x.data.dtype for x in jax.tree.leaves(state, is_leaf=so.is_stored_leaf) if isinstance(x, ScaledArray)}
    assert dtypes == {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float16)}

    ckpt = {"params": params, "opt_state": state, "key": jax.random.key_data(key)}
    restored = _save_restore(ckpt, tmp_path / "ckpt")

    _, cont = P.run(tx, steps=steps, rounding="stochastic", params=params, opt_state=state, key=key)
    _, resumed = P.run(
        tx,
        steps=steps,
        rounding="stochastic",
        params=restored["params"],
        opt_state=restored["opt_state"],
        key=jax.random.wrap_key_data(restored["key"]),
    )
    np.testing.assert_array_equal(np.asarray(cont), np.asarray(resumed))
    assert np.all(np.isfinite(np.asarray(cont)))


def test_checkpoint_of_8bit_and_coat_leaves(tmp_path):
    x = jax.random.normal(jax.random.key(0), (3, 1500)) * 1e-3
    leaves = jax.jit(
        lambda x: {
            "m8": so.BlockwiseCodec(True).encode(x),
            "v8": so.BlockwiseCodec(False).encode(x * x),
            "coat": so.CoatCodec().encode(x),
            "coat_plain": so.CoatCodec(expand=False).encode(x),
        }
    )(x)
    restored = _save_restore(leaves, tmp_path / "leaves")
    for name in leaves:
        assert type(restored[name]) is type(leaves[name])
    assert restored["v8"].signed is False and restored["coat"].group_size == 128
    assert restored["coat_plain"].k is None
