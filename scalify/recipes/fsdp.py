"""Fully sharded data parallelism (FSDP, ZeRO-3) of a recipe's step over one mesh axis.

    mesh = scalify.distributed.make_mesh()                # every device on axis "data"
    fsdp = scalify.recipes.FSDP(mesh)
    train = recipe.train_step(loss_fn, optimizer, fsdp=fsdp)
    state = train.init(params)                           # each array cut over the devices
    state, metrics = train.step(state, fsdp.place_batch(batch))

- The state is sharded: every array of the masters, the optimizer state and the model
  state along its largest dimension divisible by the number of devices
  (`scalify.distributed.fsdp_specs`; arrays under `min_size` elements replicated); the
  scales, the step count and the delayed statistics are replicated.
- The step is one program that XLA partitions (GSPMD): it all-gathers each parameter where
  the forward and backward passes use it and reduce-scatters its gradient to the shard;
  the optimizer updates each shard where it lives. The step's outputs have the inputs'
  shardings, so it compiles once.
- With an FP8 recipe, XLA's GPU partitioner moves each all-gather of an FP8 matmul's
  kernel past its cast to E4M3: the kernels cross the wire as one byte a weight. Where it
  partitions a matmul another way (the activations gathered instead of a large kernel, when
  that moves fewer bytes) it may, as for bf16. `fp8_gather=True` forces every such kernel
  (the `TransposedKernel` leaves) to be all-gathered as E4M3 words
  (`scalify.distributed.gather_as`; the same values, since the matmul quantises the kernel
  to E4M3 at the same scale): on backends that widen FP8 collectives (XLA:CPU), or to
  compare plans.
- The batch is split along its first dimension over the axis: its size must be a multiple
  of the number of devices. The values are those of the one-device step up to the order of
  the sums across devices.

With several processes (`jax.distributed`, one per GPU), `place` and `place_batch` take
values every process holds alike; `init` takes parameters that are global arrays or the
same host values in every process.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scalify.core.scaled_array import ScaledArray, is_scaled_leaf
from scalify import distributed
from scalify.distributed import DATA_AXIS, fsdp_specs, gather_as
from scalify.recipes.kernel_layout import TransposedKernel

__all__ = ["FSDP"]

# The format the FP8 matmuls of a recipe quantise their kernels to (`Fp8DotGeneral`).
KERNEL_WIRE = jnp.float8_e4m3fn


def _is_tracer(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _data_spec(spec):
    return spec.data if isinstance(spec, ScaledArray) else spec


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Shard a recipe's training step over `mesh` axis `axis` (module doc).

    Attributes:
      mesh: the device mesh (`scalify.distributed.make_mesh`).
      axis: the mesh axis that the state and the batch are split over.
      min_size: arrays with fewer elements are replicated.
      fp8_gather: all-gather every kernel of an FP8 recipe's matmuls as E4M3 words (False:
        XLA plans each parameter's collectives).
    """

    mesh: Mesh
    axis: str = DATA_AXIS
    min_size: int = 2**10
    fp8_gather: bool = False

    def __post_init__(self):
        if self.axis not in self.mesh.shape:
            raise ValueError(f"FSDP: the mesh has axes {tuple(self.mesh.shape)}, not {self.axis!r}; "
                             f"give FSDP(mesh, axis=...) one of them.")

    @property
    def size(self) -> int:
        """The number of devices along `axis`."""
        return int(self.mesh.shape[self.axis])

    def _sharded(self, tree):
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s),
                                      fsdp_specs(tree, self.mesh, self.axis, min_size=self.min_size),
                                      is_leaf=lambda s: isinstance(s, P))

    def _replicated(self, tree):
        return jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, P()), tree)

    def state_shardings(self, state) -> Any:
        """NamedShardings of a `TrainState` (arrays or `jax.ShapeDtypeStruct`s): params,
        optimizer state and model state sharded, the step count and statistics replicated."""
        return type(state)(self._sharded(state.params), self._sharded(state.opt_state),
                           self._replicated(state.step), self._sharded(state.model_state),
                           self._replicated(state.statistics))

    def place(self, state):
        """`state` laid out as `state_shardings` says: `jax.device_put` of concrete values
        (through host copies when several processes run), a sharding constraint inside a
        trace."""
        shardings = self.state_shardings(state)
        if _is_tracer(state):
            return jax.lax.with_sharding_constraint(state, shardings)
        return distributed.place(state, shardings)

    @staticmethod
    def host_or_global(tree):
        """Arguments for a jitted function on the mesh: with several processes, every array
        that is not a global one (a process's own device array) as a host copy, which
        `jax.jit` takes as the same value in every process; with one process, `tree` as it
        is."""
        if jax.process_count() == 1:
            return tree
        return jax.tree_util.tree_map(
            lambda x: x if not isinstance(x, jax.Array) or not x.is_fully_addressable else np.asarray(x), tree)

    def replicate(self, x):
        """A small host array `x` replicated on the mesh (built by each device, so that no
        cross-process equality check meets the NaN of an empty statistics record)."""
        x = np.asarray(x)
        return jax.jit(lambda: jnp.asarray(x), out_shardings=NamedSharding(self.mesh, P()))()

    def batch_sharding(self) -> NamedSharding:
        """The batch's sharding: split along its first dimension over `axis`."""
        return NamedSharding(self.mesh, P(self.axis))

    def check_batch(self, batch) -> None:
        """Raise if a batch array's first dimension is not a multiple of the devices."""
        for x in jax.tree_util.tree_leaves(batch):
            if np.ndim(x) == 0 or np.shape(x)[0] % self.size:
                raise ValueError(f"FSDP over {self.size} devices splits each batch array along its first "
                                 f"dimension; an array of shape {tuple(np.shape(x))} does not split. Give "
                                 f"batches whose first dimension is a multiple of {self.size}.")

    def place_batch(self, batch):
        """`batch` split over the devices along its first dimension (the same host values in
        every process)."""
        self.check_batch(batch)
        return distributed.place(batch, jax.tree_util.tree_map(lambda _: self.batch_sharding(), batch))

    def constrain_batch(self, batch):
        """Inside the step: the batch split over the devices."""
        self.check_batch(batch)
        return jax.lax.with_sharding_constraint(batch, jax.tree_util.tree_map(lambda _: self.batch_sharding(),
                                                                              batch))

    def gather(self, recipe, params):
        """Inside the step, before the loss: each sharded `TransposedKernel` of an FP8
        recipe all-gathered as E4M3 (`gather_as`; straight-through gradient, reduce-scattered
        back to the shard). Other parameters as they are: XLA gathers them."""
        if not (recipe.fp8 and self.fp8_gather):
            return params
        replicated = NamedSharding(self.mesh, P())

        def one(leaf):
            if not isinstance(leaf, TransposedKernel):
                return leaf
            spec = _data_spec(fsdp_specs(leaf.out_in, self.mesh, self.axis, min_size=self.min_size))
            if all(e is None for e in spec):
                return leaf
            source = NamedSharding(self.mesh, spec)
            return TransposedKernel(gather_as(leaf.out_in, KERNEL_WIRE, replicated, source=source))

        return jax.tree_util.tree_map(one, params, is_leaf=lambda x: isinstance(x, TransposedKernel))

