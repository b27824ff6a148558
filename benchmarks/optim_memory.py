"""Memory and accuracy of the low-precision optimizers of `scalify.optim`.

Writes `results/cpu/optim_memory/optim_memory.md` (quoted by docs/optimizers.md) and
`optim_memory.json`:

1. Bytes per parameter of the optimizer state and of the master weights, measured from
   the arrays of a real parameter tree: the `small` GPT preset of experiments/nanogpt
   (23.2M parameters), after one update with random gradients.
2. Trajectory deltas on the small problem of the tests (tests/optim/optim_problem.py:
   2-layer MLP regression, 300 full-batch AdamW steps, float32 model): final loss and
   worst per-step deviation from `optax.adamw` in float32.
3. Small updates (lr 1e-5): how much of float32's loss decrease FP16 master weights keep
   with round-to-nearest and with stochastic rounding.
4. Reproductions on real Adam moments (tests/optim/optim_lm.py: word-level LM on
   WikiText-103 validation text when SCALIFY_WIKITEXT_DIR names a directory holding
   `wiki.valid.tokens`, else the pydoc topics of CPython; the committed results used the
   WikiText-103 validation split): the 8-bit paper's linear / dynamic / block-wise
   comparison, and COAT's Table 1 (error of m / sqrt(v)).

Run from the repository root (CPU is enough, ~2 minutes):

    SCALIFY_WIKITEXT_DIR=path/to/wikitext python benchmarks/optim_memory.py
"""
from __future__ import annotations

import json
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "optim")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optim_lm  # noqa: E402
import optim_problem as P  # noqa: E402
import scalify.optim as so  # noqa: E402
import scalify.quant as q  # noqa: E402
from experiments.nanogpt.model import get_config, init_params  # noqa: E402

OUT = ROOT / "results" / "cpu" / "optim_memory"
LR = 3e-4


def memory_table():
    params = init_params(get_config("small"), jax.random.key(0))
    n = so.parameter_count(params)
    grads = jax.tree.map(lambda p: 1e-3 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    variants = [
        ("AdamW float32 (`optax.adamw`)", optax.adamw(LR)),
        ("FP16 scaled state (`scaled_state(optax.adamw)`)", so.scaled_state(optax.adamw(LR))),
        ("FP8-LM (`adamw_fp8lm`)", so.adamw_fp8lm(LR)),
        ("8-bit block-wise (`adamw_8bit`)", so.adamw_8bit(LR)),
        ("COAT (`adamw_coat`)", so.adamw_coat(LR)),
    ]
    master = {
        "float32": so.bytes_per_parameter(params, params),
        "fp16_scaled": so.bytes_per_parameter(jax.jit(so.scaled_params)(params), params),
    }
    rows = []
    for name, tx in variants:
        t0 = time.perf_counter()
        state = jax.jit(tx.init)(params)
        _, state = jax.jit(tx.update)(grads, state, params)
        jax.block_until_ready(state)
        bpp = so.bytes_per_parameter(state, params)
        rows.append(
            {
                "variant": name,
                "state": bpp,
                "with_f32_master": bpp + master["float32"],
                "with_fp16_master": bpp + master["fp16_scaled"],
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"{name}: {bpp:.4f} bytes/param ({rows[-1]['seconds']:.1f} s)", flush=True)
    return n, master, rows


TRAJECTORY_VARIANTS = [
    # name, transformation factory, master dtype, rounding
    ("AdamW float32 (reference)", lambda: optax.adamw(P.LR), None, "nearest"),
    # A noise floor: the same float32 run from weights perturbed by 1e-6 relative.
    ("AdamW float32, initial weights x (1 + 1e-6 noise)", lambda: optax.adamw(P.LR), "perturb", "nearest"),
    ("FP16 scaled state", lambda: so.scaled_state(optax.adamw(P.LR)), None, "nearest"),
    ("FP16 scaled state + FP16 master, nearest", lambda: so.scaled_state(optax.adamw(P.LR)), jnp.float16, "nearest"),
    ("FP16 scaled state + FP16 master, stochastic", lambda: so.scaled_state(optax.adamw(P.LR)), jnp.float16, "stochastic"),
    ("FP8-LM + FP16 master, nearest", lambda: so.adamw_fp8lm(P.LR), jnp.float16, "nearest"),
    ("FP8-LM + FP16 master, stochastic", lambda: so.adamw_fp8lm(P.LR), jnp.float16, "stochastic"),
    ("8-bit (every tensor)", lambda: so.adamw_8bit(P.LR, min_size=2), None, "nearest"),
    ("8-bit (every tensor) + FP16 master, stochastic", lambda: so.adamw_8bit(P.LR, min_size=2), jnp.float16, "stochastic"),
    ("COAT", lambda: so.adamw_coat(P.LR), None, "nearest"),
    ("COAT + FP16 master, stochastic", lambda: so.adamw_coat(P.LR), jnp.float16, "stochastic"),
    ("COAT, no expansion", lambda: so.adamw_coat(P.LR, expand=False), None, "nearest"),
    (
        "COAT, expansion to fmax^2/2 (COAT kernel's range)",
        lambda: so.quantized_state(
            optax.adamw(P.LR),
            so.moment_codecs(*(2 * [so.CoatCodec(target_range=q.default_target_range())])),
        ),
        None,
        "nearest",
    ),
]


def trajectory_table():
    rows, ref = [], None
    for name, make, master, rounding in TRAJECTORY_VARIANTS:
        t0 = time.perf_counter()
        params = None
        if master == "perturb":
            noise = lambda p, k: p * (1 + 1e-6 * jax.random.normal(k, p.shape))  # noqa: E731
            leaves, treedef = jax.tree.flatten(P.init_params())
            keys = jax.random.split(jax.random.key(99), len(leaves))
            params, master = jax.tree.unflatten(treedef, [noise(p, k) for p, k in zip(leaves, keys)]), None
        _, losses = P.run(make(), master_dtype=master, rounding=rounding, params=params)
        losses = np.asarray(losses, np.float64)
        ref = losses if ref is None else ref
        rows.append(
            {
                "variant": name,
                "final_loss": float(losses[-1]),
                "final_delta": float(losses[-1] / ref[-1] - 1),
                "worst_step_delta": float(np.max(np.abs(losses / ref - 1))),
            }
        )
        print(f"{name}: final {losses[-1]:.6f} ({rows[-1]['final_delta']:+.2%}, {time.perf_counter() - t0:.1f} s)", flush=True)
        if len(rows) == 1:
            reference = losses
    rows.append(scalified_row(reference))
    return rows


def scalified_row(ref):
    """The whole step under `jit(scalify(step))`: the model runs on the FP16 data of the
    scaled master weights (FP16 scaled gradients), FP16 scaled state, stochastic rounding."""
    import scalify

    x, y = P.data()
    tx = so.scaled_state(optax.adamw(P.LR))
    params = so.scaled_params(P.init_params(), jnp.float16)
    state = tx.init(params)

    def step(params, state, key):
        loss, grads = jax.value_and_grad(P.loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return so.apply_updates(params, updates, rounding="stochastic", key=key), state, loss

    f = jax.jit(scalify.scalify(step))
    losses = []
    for i in range(P.STEPS):
        params, state, loss = f(params, state, jax.random.key(i))
        losses.append(float(so.values({"l": loss})["l"]))
    losses = np.asarray(losses, np.float64)
    row = {
        "variant": "scalify(step): FP16 model data and gradients, FP16 scaled state, FP16 master, stochastic",
        "final_loss": float(losses[-1]),
        "final_delta": float(losses[-1] / ref[-1] - 1),
        "worst_step_delta": float(np.max(np.abs(losses / ref - 1))),
    }
    print(f"{row['variant']}: final {losses[-1]:.6f} ({row['final_delta']:+.2%})", flush=True)
    return row


def small_update_table(lr=1e-5):
    rows, ref_drop = [], None
    for name, master, rounding in [
        ("float32 master", None, "nearest"),
        ("FP16 scaled master, round-to-nearest", jnp.float16, "nearest"),
        ("FP16 scaled master, stochastic rounding", jnp.float16, "stochastic"),
    ]:
        # float32 state through `scaled_state`, which reads ScaledArray params.
        _, losses = P.run(so.scaled_state(optax.adamw(lr), jnp.float32), master_dtype=master, rounding=rounding)
        losses = np.asarray(losses, np.float64)
        drop = losses[0] - losses[-1]
        ref_drop = drop if ref_drop is None else ref_drop
        rows.append({"master": name, "loss_drop": float(drop), "fraction_of_f32": float(drop / ref_drop)})
        print(f"lr {lr}: {name}: drop {drop:.3e}", flush=True)
    return lr, rows


def reproductions():
    _, moments = optim_lm.adam_moments()
    dyn = q.dynamic_map(signed=True)
    eight = []
    for name, m in [("embedding (1024 x 32)", moments.mu["emb"]), ("output layer (128 x 1024)", moments.mu["out"]["w"])]:
        m64 = np.asarray(m, np.float64)
        nz = m64 != 0
        for method, mq in [
            ("linear, per tensor", q.linear_dequantize(*q.linear_quantize(m))),
            ("dynamic tree, per tensor", q.dynamic_dequantize(*q.dynamic_quantize(m))),
            ("dynamic tree, blocks of 2048", q.blockwise_dequantize(*q.blockwise_quantize(m, dyn, 2048), dyn, 2048)),
        ]:
            d = np.abs(np.asarray(mq, np.float64) - m64)
            eight.append(
                {
                    "tensor": name,
                    "method": method,
                    "mean_abs_error": float(d.mean() / np.abs(m64).mean()),
                    "mean_rel_error": float(np.mean(d[nz] / np.abs(m64[nz]))),
                }
            )
    m = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.mu)])
    v = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.nu)])
    ref = m / (jnp.sqrt(v) + 1e-8)
    coat = []
    for name, cm, cv in [
        ("E4M3 / E4M3, 1x128 groups, no expansion", so.CoatCodec(expand=False), so.CoatCodec(expand=False)),
        ("E4M3 / E5M2, 1x128 groups, no expansion", so.CoatCodec(expand=False), so.CoatCodec(jnp.float8_e5m2, expand=False)),
        ("E5M2 / E5M2, 1x128 groups, no expansion", so.CoatCodec(jnp.float8_e5m2, expand=False), so.CoatCodec(jnp.float8_e5m2, expand=False)),
        ("E4M3 / E4M3, 1x128 groups, expansion (normal range, default)", so.CoatCodec(), so.CoatCodec()),
        (
            "E4M3 / E4M3, 1x128 groups, expansion (fmax^2/2, COAT kernel)",
            so.CoatCodec(target_range=q.default_target_range()),
            so.CoatCodec(target_range=q.default_target_range()),
        ),
        ("E4M3 per tensor / FP16 per tensor (FP8-LM)", so.ScaledCodec(jnp.float8_e4m3fn), so.ScaledCodec(jnp.float16)),
    ]:
        mq = jax.jit(lambda x, c=cm: c.decode(c.encode(x)))(m)
        vq = jax.jit(lambda x, c=cv: c.decode(c.encode(x)))(v)
        dq = mq / (jnp.sqrt(vq) + 1e-8)
        rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
        coat.append(
            {
                "formats": name,
                "m_rel_error": rel(mq, m),
                "v_rel_error": rel(vq, v),
                "update_mse": float(jnp.mean((dq - ref) ** 2)),
                "update_rel_error": rel(dq, ref),
            }
        )
    return optim_lm.corpus()[1], eight, coat


def markdown(n, master, mem, traj, small, repro):
    lr, small_rows = small
    corpus, eight, coat = repro
    lines = [
        "# scalify.optim: memory and accuracy",
        "",
        f"Generated by `python benchmarks/optim_memory.py` (jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, Python {platform.python_version()}). Do not edit by hand.",
        "",
        f"## Bytes per parameter (nanoGPT `small` preset, {n:,} parameters)",
        "",
        "Measured from the arrays of the optimizer state after one update (data, scales, "
        "block maxima, step counts: everything). Master weights: float32 params "
        f"{master['float32']:.4f} B/param, FP16 scaled (`scaled_params`) {master['fp16_scaled']:.4f} B/param.",
        "",
        "| optimizer | state B/param | + float32 master | + FP16 scaled master |",
        "|---|---:|---:|---:|",
    ]
    for r in mem:
        lines.append(f"| {r['variant']} | {r['state']:.4f} | {r['with_f32_master']:.4f} | {r['with_fp16_master']:.4f} |")
    lines += [
        "",
        "## Trajectory deltas (small problem, 300 steps)",
        "",
        "2-layer MLP regression (tests/optim/optim_problem.py), float32 model (the last row: "
        "the whole step scalified, the model on FP16 data), AdamW lr 1e-2. "
        "Delta = loss / float32 AdamW loss - 1 (negative: lower loss).",
        "",
        "| variant | final loss | final delta | worst per-step delta |",
        "|---|---:|---:|---:|",
    ]
    for r in traj:
        lines.append(
            f"| {r['variant']} | {r['final_loss']:.6f} | {r['final_delta']:+.2%} | {r['worst_step_delta']:.2%} |"
        )
    lines += [
        "",
        f"## Small updates (AdamW lr {lr:g}, 300 steps)",
        "",
        "Loss decrease over the run, as a fraction of the float32-master decrease. At this "
        "learning rate most updates are below half a float16 ulp of their weight.",
        "",
        "| master weights | loss decrease | fraction of float32 |",
        "|---|---:|---:|",
    ]
    for r in small_rows:
        lines.append(f"| {r['master']} | {r['loss_drop']:.3e} | {r['fraction_of_f32']:.2f} |")
    lines += [
        "",
        f"## 8-bit paper reproduction (Adam first moment, word LM on {corpus}, 40 steps)",
        "",
        "Mean absolute error (divided by mean |m|) and mean relative error (over nonzero m) of "
        "8-bit quantisation. Dettmers et al. 2022: block-wise dynamic < dynamic < linear.",
        "",
        "| tensor | method | mean abs error / mean abs m | mean relative error |",
        "|---|---|---:|---:|",
    ]
    for r in eight:
        lines.append(f"| {r['tensor']} | {r['method']} | {r['mean_abs_error']:.4f} | {r['mean_rel_error']:.4f} |")
    lines += [
        "",
        "## COAT Table 1 reproduction (same moments, all tensors)",
        "",
        "Relative L2 error of m, v and of the update direction m / (sqrt(v) + 1e-8), and the "
        "MSE of that direction. COAT: expansion lowers the error for E4M3 moments.",
        "",
        "| m / v formats | m rel. error | v rel. error | m/sqrt(v) rel. error | m/sqrt(v) MSE |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in coat:
        lines.append(
            f"| {r['formats']} | {r['m_rel_error']:.4f} | {r['v_rel_error']:.4f} | "
            f"{r['update_rel_error']:.4f} | {r['update_mse']:.3e} |"
        )
    return "\n".join(lines) + "\n"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    n, master, mem = memory_table()
    traj = trajectory_table()
    small = small_update_table()
    repro = reproductions()
    (OUT / "optim_memory.md").write_text(markdown(n, master, mem, traj, small, repro))
    (OUT / "optim_memory.json").write_text(
        json.dumps(
            {
                "params": n,
                "master": master,
                "memory": mem,
                "trajectory": traj,
                "small_updates": {"lr": small[0], "rows": small[1]},
                "eight_bit": repro[1],
                "coat": repro[2],
            },
            indent=2,
        )
    )
    print(f"wrote {OUT / 'optim_memory.md'}")


if __name__ == "__main__":
    main()
