"""Precision recipes: one call turns a loss function and an optax optimizer into a fast
low-precision training step.

    recipe = scalify.recipes.FP8                       # or FP32, FP16, FP16_MASTER, FP8_FP16_STATE, FP8_BF16
    train = recipe.train_step(loss_fn, optax.adamw(3e-4))
    state = train.init(params)                          # float32 params in
    state, metrics = train.step(state, batch)           # jitted, scalified whole step

Over several devices: `recipe.train_step(loss_fn, optimizer, fsdp=scalify.recipes.FSDP(mesh))`.

See docs/recipes.md.
"""
from scalify.recipes.fsdp import FSDP
from scalify.recipes.kernel_layout import TransposedKernel
from scalify.recipes.precision import precision
from scalify.recipes.recipe import (
    FP8,
    FP8_BF16,
    FP8_FP16_STATE,
    FP16,
    FP16_MASTER,
    FP32,
    RECIPES,
    Recipe,
    get,
)
from scalify.recipes.train_step import TrainState, TrainStep, conform, train_step, wrap_optimizer

__all__ = [
    "Recipe",
    "FP32",
    "FP16",
    "FP16_MASTER",
    "FP8",
    "FP8_FP16_STATE",
    "FP8_BF16",
    "RECIPES",
    "get",
    "precision",
    "train_step",
    "TrainStep",
    "TrainState",
    "conform",
    "wrap_optimizer",
    "TransposedKernel",
    "FSDP",
]
