"""Host time of a recipe step's first call on the stock GPT of benchmarks/stock_gpt.py,
before XLA compiles: sizing the delayed statistics (an abstract trace of the step, made by
`init(params, batch=...)` or by `TrainStep.step`'s first call) against the trace and
lowering of the sized step. `sizing_s` is `init` with `batch` less `init` without it.
Everything is abstract (no parameter is materialised); the host's work is the same on any
backend.

    PYTHONPATH=$PWD python results/cpu/recipe_first_call/run.py [SIZE ...] > OUT.json
"""
import json
import sys
import time

import jax
import jax.numpy as jnp

import scalify
from benchmarks import stock_gpt as sg


def measure(size_name: str, recipe: str) -> dict:
    size = sg.SIZES[size_name]
    model = sg.build_model("gpt", size, None)
    tokens = jax.ShapeDtypeStruct((size["batch"], size["seq"]), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    train = scalify.recipes.get(recipe).train_step(sg.make_loss_fn(model), sg.make_optimizer())
    batch = (tokens, tokens)
    t0 = time.perf_counter()
    jax.eval_shape(train.init, variables)
    t1 = time.perf_counter()
    sized = jax.eval_shape(lambda v: train.init(v, batch=batch), variables)
    t2 = time.perf_counter()
    train.step.trace(sized, batch).lower()
    t3 = time.perf_counter()
    return {"size": size_name, "recipe": recipe, "sites": int(sized.statistics.shape[0]),
            "sizing_s": round((t2 - t1) - (t1 - t0), 2), "trace_lower_s": round(t3 - t2, 2)}


if __name__ == "__main__":
    sizes = sys.argv[1:] or ["d1024", "d2048"]
    rows = [measure(s, r) for s in sizes for r in ("fp8", "fp16")]
    print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), "rows": rows}, indent=1))
