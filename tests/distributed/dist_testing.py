"""Shared helpers of the 8-device tests (a module with a unique name: test directories are
not packages, so `import conftest` could find another directory's conftest)."""
import jax

N_DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
SKIP_REASON = (f"needs {N_DEVICES} devices; JAX was initialised before tests/distributed/conftest.py "
               "could set XLA_FLAGS, so test_dist_subprocess.py runs these tests in a subprocess")


def have_devices() -> bool:
    return jax.device_count() >= N_DEVICES


def nanogpt_runs(mesh, modes, steps=2):
    """`steps` train steps of the tiny NanoGPT (float32 recipe) in each mode of
    `experiments/nanogpt/parallel.py` (or "plain": the single-device step without scalify),
    from the same state and batches: {mode: losses, final state, collective stats of the
    compiled step}."""
    import jax
    import numpy as np

    from scalify.inspect import collective_bytes
    from experiments.nanogpt import configs as C
    from experiments.nanogpt import parallel as PL
    from experiments.nanogpt import step as S

    recipe = C.get_recipe("fp32")
    gpt = S.gpt_config(recipe, "tiny", n_layers=1, d_model=32, n_heads=2, seq_len=8)
    # eps=1: the update is ~lr*g, linear in the gradient, so that the comparison is not the
    # sign of near-zero gradient entries (Adam's g/sqrt(v)); no clipping.
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10, eps=1.0,
                                                clip_norm=None))
    state0 = S.init_state(recipe, gpt, tx, seed=0)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (8, 9)).astype(np.int32) for _ in range(steps)]
    out = {}
    for mode in modes:
        if mode == "plain":  # the same update without scalify, one device (faster to compile)
            step = S.make_train_step(recipe, gpt, tx, use_scalify=False)
            st = S.plain_state(state0)
        else:  # "MODE+packed": the state's float32 scalars in one vector (step.ScalePacking)
            spec, packed = mode.removesuffix("+packed"), mode.endswith("+packed")
            par = PL.parse_mesh(spec)
            packing = S.ScalePacking(state0) if packed else None
            step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, par, state0, packing=packing)
            if packed:
                st = PL.pack_state(packing, state0, mesh if par.mode != "none" else None, par.mode)
            else:
                st = state0 if par.mode == "none" else PL.shard_state(state0, mesh, par.mode)
        compiled = step.lower(st, batches[0][:, :-1], batches[0][:, 1:]).compile()
        losses = []
        for b in batches:
            st, loss = compiled(st, b[:, :-1], b[:, 1:])
            losses.append(float(loss))
        out[mode] = dict(losses=losses, state=st, stats=collective_bytes(compiled, min_elements=64),
                         arguments=len(jax.tree_util.tree_leaves(st)))
        if mode.endswith("+packed"):
            out[mode]["packed"], out[mode]["state"] = st, packing.unpack(st)
    return out


def plain_params(state):
    import jax

    from experiments.nanogpt import step as S

    return jax.tree_util.tree_leaves(S.plain_state(state).params)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
