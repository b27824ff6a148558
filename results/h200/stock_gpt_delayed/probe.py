"""The stock GPT of `benchmarks/stock_gpt.py` with recipe variants the bench does not name,
side by side with bf16 in one process (`bench_variant`, its step timing and profile).

    PYTHONPATH=$PWD python results/h200/stock_gpt_delayed/probe.py SIZE VARIANTS OUT

VARIANTS: comma-separated names of the bench (bf16, flax-fp8, a recipe) or of `VARIANTS`
below: a recipe with fields replaced, traced under a `ScalifyConfig`. Environment: STEPS,
REPEATS (timed windows), PROFILE (steps under the profiler).
"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
import scalify
from benchmarks import stock_gpt as sg
from scalify.core.config import ScalifyConfig

VARIANTS = {
    # FP8 matmuls with bfloat16 activations (the formats of Flax's FP8 ops and
    # TransformerEngine); no gradient rescale at the norms, which bfloat16 does not need.
    "fp8-bf16act": (dict(recipe="fp8", compute_dtype=jnp.bfloat16, norm_grad_rescale=False), {}),
}
_orig_setup = sg._setup
CUR = {}
def _setup(variant, arch, size, impl):
    if variant not in VARIANTS:
        return _orig_setup(variant, arch, size, impl)
    rdict, _ = VARIANTS[variant]
    rdict = dict(rdict); r = scalify.recipes.get(rdict.pop("recipe")).replace(name=variant, **rdict)
    model = sg.build_model(arch, size, impl)
    tokens = jnp.zeros((size["batch"], size["seq"]), jnp.int32)
    key = (arch, tuple(size.items()), False)
    if key not in sg._VARIABLES:
        import flax
        sg._VARIABLES[key] = flax.core.unfreeze(jax.jit(model.init)(jax.random.key(0), tokens))
    variables = jax.tree.map(lambda a: a.copy(), sg._VARIABLES[key])
    train = r.train_step(sg.make_loss_fn(model), sg.make_optimizer())
    return train.init, train.step, variables
sg._setup = _setup

def main():
    size_name, variants, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    arch = os.environ.get("ARCH", "gpt")
    size = sg.ARCHS[arch][size_name]
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
    steps, repeats, prof = int(os.environ.get("STEPS", 15)), int(os.environ.get("REPEATS", 2)), int(os.environ.get("PROFILE", 0))
    os.makedirs(out, exist_ok=True)
    records = []
    for v in variants:
        cfg = VARIANTS.get(v, ({}, {}))[1]
        t0 = time.time()
        with ScalifyConfig(**cfg):
            r = sg.bench_variant(v, size, impl, 5, steps, repeats, prof, out, arch=arch)
        records.append(r); sg._ratios(records)
        print(f"{size_name} {v}: {r['step_ms']:.2f} ms x{r['speedup_vs_bf16'] or 0:.3f} compile {r['compile_s']:.1f}s "
              f"loss {r['loss_first']:.3f}->{r['loss_final']:.3f} finite {r['loss_finite']} kernels "
              f"{r.get('profile', {}).get('kernels_per_step')} cat {r.get('profile', {}).get('by_category_us')} ({time.time()-t0:.0f}s)", flush=True)
        with open(f"{out}/probe_{size_name}.json", "w") as f: json.dump(records, f, indent=1, default=str)
main()
