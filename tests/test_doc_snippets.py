"""Every ```python block of README.md and docs/*.md runs here.

`SNIPPETS` lists each block by name: its file, a line that identifies it (`marker`) and
the code it runs in (`context`):

- `"{snippet}"` (the default): the block is self-contained and runs as written;
- a template with a `{snippet}` line: a fragment that continues the reader's code (uses
  `params`, `step`, a mesh, ...) runs after (or inside) the code that defines them, on
  tiny shapes; code after the block checks what it made.

`needs_gpu=True` skips the block on the CPU backend (reason "needs a GPU"); nothing else
skips. An entry may also be a `(file, marker)` or `(file, marker, context)` tuple.
`devices=N` runs the block in a subprocess with N host devices when this process
has fewer. A ```python block that no entry lists fails `test_every_python_block_is_listed`,
an entry whose block is gone fails `test_every_listed_snippet_is_in_its_file`, and a fence
without a language fails `test_every_fence_has_a_language` (use ```bash or ```text for
commands and outputs). To add docs: add their blocks here, one entry each.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Snippet:
    file: str
    marker: str
    context: str = "{snippet}"
    needs_gpu: bool = False
    devices: int = 1


_MESH_1D = '''
import jax, jax.numpy as jnp, numpy as np, scalify
from jax.sharding import PartitionSpec as P
mesh = scalify.distributed.make_mesh()
n = jax.device_count()
'''

SNIPPETS: dict[str, Snippet] = {
    # README.md
    "readme-use": Snippet("README.md", "train = scalify.recipes.FP8_BF16.train_step(loss_fn", '''
{snippet}
assert jnp.isfinite(metrics["loss"]) and params["Dense_0"]["kernel"].dtype == jnp.float32
assert state.params["Dense_0"]["kernel"].out_in.data.dtype == jnp.float16  # FP16 masters, (out, in)
assert train.step._cache_size() == 1  # every step reuses the first step's program
'''),
    # docs/recipes.md
    "recipes-call": Snippet("docs/recipes.md", "train = scalify.recipes.FP8.train_step(loss_fn, optimizer)", '''
import jax, jax.numpy as jnp, optax, scalify
params, batch, optimizer = {"w": jnp.ones((4, 4))}, jnp.ones((4,)), optax.adam(1e-3)
loss_fn = lambda p, b: jnp.sum(jnp.tanh(p["w"] @ b))
{snippet}
assert jnp.isfinite(metrics["loss"])
'''),
    # docs/fp8.md
    "fp8-way-in": Snippet("docs/fp8.md", "train = scalify.recipes.FP8_BF16.train_step(loss_fn, optax.adamw(3e-4))", '''
import flax.linen as nn, jax, jax.numpy as jnp, optax, scalify
model = nn.Dense(8, dtype=jnp.bfloat16)
x = jnp.ones((4, 16))
params = model.init(jax.random.PRNGKey(0), x)["params"]
loss_fn = lambda p, b: jnp.mean(model.apply({"params": p}, b).astype(jnp.float32) ** 2)
batch = x
{snippet}
assert jnp.isfinite(metrics["loss"])
'''),
    "recipes-keep": Snippet("docs/recipes.md", "recipe = scalify.recipes.FP8.replace(keep=(\"classifier\",))", '''
{snippet}
assert jnp.isfinite(metrics["loss"])
'''),
    "recipes-nnx": Snippet("docs/recipes.md", "train = scalify.recipes.FP16_MASTER.train_step(loss_fn", '''
{snippet}
assert jnp.isfinite(metrics["loss"]) and isinstance(model, nnx.Sequential)
'''),
    "recipes-orbax": Snippet("docs/recipes.md", "ckpt = orbax.checkpoint.StandardCheckpointer()", '''
import tempfile, pathlib, orbax.checkpoint, jax, jax.numpy as jnp, optax, scalify
params = {"w": jnp.ones((4, 4))}
train = scalify.recipes.FP16.train_step(lambda p, b: jnp.sum(p["w"] @ b), optax.sgd(0.1))
batch = jnp.ones((4,))
state, _ = train.step(train.init(params), batch)
path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
{snippet}
ckpt.wait_until_finished() if hasattr(ckpt, "wait_until_finished") else None
state, _ = train.step(state, batch)
assert train.step._cache_size() == 1
'''),
    # docs/concepts.md
    "concepts-rounding-mode": Snippet("docs/concepts.md", 'rounding_mode="nearest"'),
    "concepts-adding-a-rule": Snippet("docs/concepts.md", 'larger_p = Primitive("larger")'),
    # docs/architecture.md
    "architecture-scale-rule": Snippet("docs/architecture.md", 'halve_p = Primitive("halve")'),
    "architecture-call-rule": Snippet("docs/architecture.md", 'inline_call_p = Primitive("inline_call")'),
    "architecture-op": Snippet("docs/architecture.md", 'unit_p = define_primitive("unit_scale"'),
    "architecture-codec": Snippet("docs/architecture.md", "class Bfloat16Codec:"),
    # docs/frameworks.md
    "frameworks-nnx": Snippet("docs/frameworks.md", "step = nnx.jit(scalify.scalify(train_step))"),
    "frameworks-equinox": Snippet("docs/frameworks.md", "step = eqx.filter_jit(scalify.scalify(train_step))"),
    # docs/existing_model.md
    "existing-model-recipe": Snippet("docs/existing_model.md", "report = scalify.inspect.scale_health("),
    "existing-model-master": Snippet("docs/existing_model.md", "def master_step(", '''
import pathlib  # the page's model and data first (its first block, up to the recipe's step,
# which existing-model-recipe runs): model, params, x, y
recipe = pathlib.Path("docs/existing_model.md").read_text().split("```python\\n")[1].split("```")[0]
exec(recipe[:recipe.index("\\ndef step(")])
{snippet}
import numpy as np
assert np.isfinite(float(loss)) and mparams["params"]["Dense_0"]["kernel"].dtype == jnp.float16
'''),
    # docs/fp8.md
    "fp8-dense-roles": Snippet("docs/fp8.md", "fp8 = functools.partial(Dense"),
    "fp8-existing-flax-model": Snippet("docs/fp8.md", "scalify.nn.fp8_everywhere():"),
    "fp8-delayed-scaling-loss": Snippet("docs/fp8.md", "def loss(params, stats, batch):", '''
import jax, jax.numpy as jnp
from scalify.nn import Dense
from scalify.ops.fp8 import E4M3, E5M2
model = Dense(8, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2, scaling="delayed")
batch = jnp.full((4, 16), 0.5)
variables = model.init(jax.random.PRNGKey(0), batch)
params, stats = variables["params"], variables["fp8_stats"]
{snippet}
assert float(stats["input_amax_history"][0]) == 0.5  # overwritten with this step's amax
'''),
    "fp8-compiler-options": Snippet("docs/fp8.md", "step = jax.jit(scalify.scalify(update), compiler_options", '''
import jax, jax.numpy as jnp, numpy as np, scalify
def update(x):
    return (x * 3.0).astype(jnp.float16)
{snippet}
out = step(scalify.as_scaled_array(jnp.ones(3, jnp.float16)))
np.testing.assert_array_equal(np.asarray(scalify.asarray(out), np.float32), 3.0)
'''),
    "fp8-count-gemms": Snippet("docs/fp8.md", "print(count_fp8_gemms(hlo))", '''
import jax, jax.numpy as jnp, scalify
from scalify.nn import Dense
from scalify.ops.fp8 import E4M3, E5M2
layer = Dense(16, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2,
              output_dtype=jnp.bfloat16)
x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))
params = layer.init(jax.random.PRNGKey(0), x)["params"]
loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32))
step = scalify.scalify(jax.grad(loss, argnums=(0, 1)))
args = (scalify.as_scaled_array(params), scalify.as_scaled_array(x))
{snippet}
if jax.default_backend() == "cpu":
    assert count_fp8_gemms(hlo) == 0
'''),
    # docs/optimizers.md
    "optimizers-usage": Snippet("docs/optimizers.md", "tx = so.scaled_state(optax.adamw(", '''
import jax, jax.numpy as jnp
loss_fn = lambda params, batch: jnp.mean((batch @ params["w"]) ** 2)
params = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 4))}
batch, key = jnp.ones((8, 16)), jax.random.PRNGKey(1)
{snippet}
params, opt_state, loss = step(params, opt_state, batch, key)
assert params["w"].data.dtype == jnp.float16 and jnp.isfinite(loss)
'''),
    # docs/distributed.md
    "distributed-scalify-and-shard-map": Snippet("docs/distributed.md", "# 1. scalify outside", _MESH_1D + '''
params = scalify.as_scaled_array({"w": jax.random.normal(jax.random.PRNGKey(0), (4, 4))})
batch = scalify.as_scaled_array(jax.random.normal(jax.random.PRNGKey(1), (2 * n, 4)))
{snippet}
one, two = step(params, batch), jax.jit(sm)(params, batch)
# Both are the gradient of the mean loss over the whole batch (float32 sums in another order).
ref = jax.grad(lambda p, b: jnp.mean((b @ p["w"]) ** 2))(scalify.asarray(params), scalify.asarray(batch))
np.testing.assert_allclose(one["w"].to_array(), ref["w"], rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(two["w"].to_array(), ref["w"], rtol=1e-5, atol=1e-6)
'''),
    "distributed-scaled-collectives": Snippet("docs/distributed.md", "D.scaled_pmean(grads", _MESH_1D + '''
def body(grads, x):
    {snippet}
    return grads, shard, total

grads, x = {"w": jnp.ones((4 * n, 8))}, jnp.arange(8.0)
out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                            out_specs=({"w": P()}, {"w": P("data")}, P()), check_vma=False))(grads, x)
np.testing.assert_array_equal(out[0]["w"], grads["w"])  # plain arrays in: plain arrays out
np.testing.assert_array_equal(out[1]["w"], grads["w"])
np.testing.assert_array_equal(out[2], n * x)
'''),
    "distributed-bfloat16-weight-gradients": Snippet("docs/distributed.md", "def device_grads(params, x):", _MESH_1D + '''
from scalify import distributed as D
{snippet}
x = jax.random.normal(jax.random.PRNGKey(0), (4 * n, 32))
params = scalify.as_scaled_array(layer.init(jax.random.PRNGKey(1), x))
grads = scalify.asarray(grads_fn(params, scalify.as_scaled_array(x)))
kernel = grads["params"]["kernel"]
assert kernel.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(kernel))) and bool(jnp.any(kernel != 0))
# the values are bfloat16 ones (what the bfloat16 wire carries)
np.testing.assert_array_equal(kernel, kernel.astype(jnp.bfloat16).astype(jnp.float32))
'''),
    "distributed-gather-as": Snippet("docs/distributed.md", "w_full = D.gather_as(", _MESH_1D + '''
from jax.sharding import NamedSharding
from scalify import distributed as D
w = jax.device_put(jnp.arange(32.0 * n).reshape(8 * n, 4) / 16, NamedSharding(mesh, P("data")))

@jax.jit
def gather(w_shard):
    {snippet}
    return w_full

np.testing.assert_array_equal(gather(w), w.astype(jnp.float8_e4m3fn).astype(jnp.float32))
ops = scalify.inspect.collective_bytes(gather.lower(w).compile())["ops"]
assert [(o.op, o.dtypes, o.operand_bytes) for o in ops] == [("all-gather", ("u8",), 32)]
''', devices=8),
    "distributed-collective-bytes": Snippet("docs/distributed.md", "scalify.inspect.collective_bytes(", _MESH_1D + '''
from scalify import distributed as D
step = jax.shard_map(lambda g: jax.lax.psum(g, "data"), mesh=mesh, in_specs=P("data"),
                     out_specs=P())
args = (jnp.ones((1024 * n,)),)
{snippet}
assert stats["wire_bytes"] == sum(op.wire_bytes for op in stats["ops"])
'''),
    "distributed-meshes": Snippet("docs/distributed.md", "mesh = D.make_mesh(4)", '''
import jax, jax.numpy as jnp
from scalify import distributed as D
state = {"w": jnp.ones((64, 32)), "b": jnp.ones((3,))}
{snippet}
assert mesh.shape == {"data": 4, "model": 2}
from jax.sharding import PartitionSpec as P
assert state_sh["w"].spec in (P("data"), P("data", None)) and state_sh["b"].spec == P()
assert state["w"].sharding == state_sh["w"] and state["b"].sharding == state_sh["b"]  # placed
''', devices=8),
    "distributed-several-hosts": Snippet("docs/distributed.md", "jax.distributed.initialize(", '''
# No coordinator here: the arguments are bound to jax.distributed.initialize's signature
# (so a renamed or removed keyword fails) instead of connecting.
import inspect, os, jax
_initialize, _rank = jax.distributed.initialize, os.environ.get("RANK")
jax.distributed.initialize = lambda *a, **k: inspect.signature(_initialize).bind(*a, **k)
os.environ["RANK"] = "0"
try:
    {snippet}
finally:
    jax.distributed.initialize = _initialize
    if _rank is None:
        del os.environ["RANK"]
assert mesh.axis_names == ("data",)
'''),
}

# Entries may also be plain (file, marker[, context]) tuples.
SNIPPETS = {k: v if isinstance(v, Snippet) else Snippet(*v) for k, v in SNIPPETS.items()}

_FENCE = re.compile(r"^([ \t]*)```([^\n`]*)$", re.M)


def _doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path: Path):
    """(line, language, code) of every fenced block of `path`, indented ones dedented."""
    text = path.read_text()
    out, opened = [], None
    for m in _FENCE.finditer(text):
        if opened is None:
            opened = m
            continue
        if m.group(2).strip() or m.group(1) != opened.group(1):
            continue  # not the closing fence of the open block
        line = text.count("\n", 0, opened.start()) + 1
        body = text[opened.end() + 1 : m.start()]
        lang = (opened.group(2).split() or [""])[0]  # "```python title" is python
        out.append((line, lang, textwrap.dedent(body)))
        opened = None
    assert opened is None, f"{path.name}: unclosed ``` fence at offset {opened.start()}"
    return out


def _python_blocks(path: Path):
    return [(line, code) for line, lang, code in _blocks(path) if lang == "python"]


def _source(name: str) -> str:
    spec = SNIPPETS[name]
    found = [code for _, code in _python_blocks(ROOT / spec.file) if spec.marker in code]
    assert len(found) == 1, (
        f"{spec.file}: {len(found)} ```python blocks contain {spec.marker!r} (SNIPPETS[{name!r}] "
        "wants exactly one): update the entry's marker, or remove the entry with the block."
    )
    lines = spec.context.strip("\n").split("\n")
    at = [i for i, ln in enumerate(lines) if ln.strip() == "{snippet}"]
    assert len(at) == 1, f"SNIPPETS[{name!r}].context needs one '{{snippet}}' line"
    indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    body = textwrap.indent(found[0], indent, lambda ln: True).rstrip("\n").split("\n")
    return "\n".join(lines[: at[0]] + body + lines[at[0] + 1 :]) + "\n"


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_runs(name, monkeypatch):
    spec = SNIPPETS[name]
    if spec.needs_gpu and jax.default_backend() == "cpu":
        pytest.skip("needs a GPU")
    code = _source(name)
    if spec.devices > jax.device_count():
        flags = os.environ.get("XLA_FLAGS", "")
        env = {**os.environ, "PYTHONPATH": str(ROOT),
               "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={spec.devices}",
               "JAX_PLATFORMS": "cpu"}  # host devices, also where the accelerator has fewer
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{spec.file} ({name}) failed:\n{run.stderr[-4000:]}"
        return
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    # A module of its own in sys.modules: classes a snippet defines (a Flax module is a
    # dataclass) look their module up there.
    module = types.ModuleType(f"snippet_{name}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, f"{spec.file} ({name})", "exec"), module.__dict__)


def test_every_python_block_is_listed():
    unlisted = []
    for path in _doc_files():
        rel = path.relative_to(ROOT).as_posix()
        markers = [(n, s.marker) for n, s in SNIPPETS.items() if s.file == rel]
        for line, code in _python_blocks(path):
            hits = [n for n, m in markers if m in code]
            if len(hits) != 1:
                unlisted.append(f"{rel}:{line} (entries matching: {hits})")
    assert not unlisted, (
        "```python blocks that no single SNIPPETS entry runs: " + ", ".join(unlisted)
        + ". Add an entry to SNIPPETS in tests/test_doc_snippets.py (a marker line that is "
        "in this block only, and a context defining what it uses), or use ```bash / ```text "
        "for blocks that are not Python."
    )


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_every_listed_snippet_is_in_its_file(name):
    spec = SNIPPETS[name]
    assert (ROOT / spec.file).is_file(), f"SNIPPETS[{name!r}]: {spec.file} does not exist"
    _source(name)


def test_every_fence_has_a_language():
    bare = [f"{p.relative_to(ROOT).as_posix()}:{line}"
            for p in _doc_files() for line, lang, _ in _blocks(p) if not lang]
    assert not bare, (f"fenced blocks without a language: {bare}; mark them ```python (and list "
                      "them in SNIPPETS), ```bash or ```text.")
