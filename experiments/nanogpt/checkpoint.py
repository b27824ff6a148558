"""Checkpoints of a training state pytree (ScaledArray leaves included) as NumPy files.

``save(dir, state, meta)`` writes ``dir/state.npz`` (one array per leaf of
``jax.tree_util.tree_flatten(state)``: a ScaledArray contributes its data and its scale) and
``dir/state.json`` (``meta``, and per leaf its path, dtype and shape). Low-precision dtypes
that NumPy files do not know (bfloat16, float8_*) are stored as their raw bits (unsigned
integers of the same width) and viewed back on restore, so a restore is bit-exact.

``restore(dir, template)`` rebuilds the state with the tree structure of ``template`` (a
freshly initialised state of the same run), checking paths, shapes and dtypes.
Writes are atomic (temporary file, then rename).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["save", "restore", "exists"]

_STATE, _META = "state.npz", "state.json"
_NATIVE = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                                   np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_)}


def exists(directory: str | Path) -> bool:
    d = Path(directory)
    return (d / _STATE).is_file() and (d / _META).is_file()


def _leaves(state):
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in flat], treedef


def _to_numpy(x) -> tuple[np.ndarray, str]:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # shards on other processes
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    a = np.asarray(jax.device_get(x))
    dtype = a.dtype
    if dtype not in _NATIVE:
        a = a.view(np.dtype(f"u{dtype.itemsize}"))
    return a, str(dtype)


def _atomic(path: Path, write) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
        write(f)
    os.replace(f.name, path)


def save(directory: str | Path, state: Any, meta: dict | None = None, write: bool = True) -> None:
    """Writes `state` and `meta` (JSON-serialisable) to `directory`. In a multi-process run
    every process calls it (arrays sharded over processes are gathered, a collective) and
    one passes ``write=True``."""
    d = Path(directory)
    leaves, _ = _leaves(state)
    arrays, info = {}, []
    for i, (path, leaf) in enumerate(leaves):
        a, dtype = _to_numpy(leaf)
        arrays[f"leaf_{i}"] = a
        info.append({"path": path, "dtype": dtype, "shape": list(a.shape)})
    if not write:
        return
    d.mkdir(parents=True, exist_ok=True)
    _atomic(d / _STATE, lambda f: np.savez(f, **arrays))
    doc = {"meta": meta or {}, "leaves": info}
    _atomic(d / _META, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def _placed(a: np.ndarray, leaf: Any) -> jax.Array:
    """`a` on the devices of the template's `leaf`, with its sharding: a jitted step then
    sees the restored state exactly as it saw the fresh one (an array placed with a sharding
    and an uncommitted one lower to different programs: a resumed run would compile its
    step again). A leaf with shards on other processes, or not a JAX array: `jnp.asarray`."""
    if isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
        return jax.device_put(a, leaf.sharding)
    return jnp.asarray(a)


def restore(directory: str | Path, template: Any) -> tuple[Any, dict]:
    """(state, meta) read from `directory`, with the structure of `template`."""
    d = Path(directory)
    doc = json.loads((d / _META).read_text())
    leaves, treedef = _leaves(template)
    info = doc["leaves"]
    if len(info) != len(leaves):
        raise ValueError(
            f"Checkpoint {d} has {len(info)} leaves, the state has {len(leaves)}: it was written "
            "by a different config or model. Use another --out or drop --resume.")
    out = []
    with np.load(d / _STATE) as z:
        for i, ((path, leaf), li) in enumerate(zip(leaves, info)):
            a = z[f"leaf_{i}"]
            dtype = jnp.dtype(li["dtype"])
            if a.dtype != dtype:
                a = a.view(dtype)
            want = (str(jnp.result_type(leaf)), list(np.shape(leaf)))
            if li["path"] != path or (li["dtype"], li["shape"]) != want:
                raise ValueError(
                    f"Checkpoint {d} leaf {i} is {li['path']} {li['dtype']}{li['shape']}, the state "
                    f"expects {path} {want[0]}{want[1]}: different config or model.")
            out.append(_placed(a, leaf))
    return jax.tree_util.tree_unflatten(treedef, out), doc["meta"]
