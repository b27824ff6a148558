"""A GPT-2-style decoder in Flax linen, with injectable linear, norm and activation layers.

The architecture is GPT-2 (Radford et al. 2019) as in nanoGPT: token + learned position
embeddings, ``n_layers`` pre-LayerNorm blocks (causal multi-head self-attention, GELU MLP,
residual connections), a final LayerNorm and an output head tied to the token embedding
(``embed.attend``).

Every linear layer is built through ``config.dense_cls``, every normalisation through
``config.layernorm_cls``, the MLP non-linearity is ``config.activation`` and the embeddings
use ``config.embed_cls``. These default to ``flax.linen.Dense``, ``flax.linen.LayerNorm``,
GELU and ``flax.linen.Embed``; a scalify FP8/FP16 ``Dense`` or a LayerNorm with a scaled
backward rule is substituted without changing the model code::

    config = get_config("small", dense_cls=MyFp8Dense, layernorm_cls=MyScaledLayerNorm)

The classes are called with exactly these keyword arguments (and nothing else):

- ``dense_cls(features, use_bias=..., dtype=..., param_dtype=..., kernel_init=..., name=...)``
- ``layernorm_cls(epsilon=..., dtype=..., param_dtype=..., name=...)``
- ``embed_cls(num_embeddings, features, dtype=..., param_dtype=..., embedding_init=...,
  name=...)``; the token embedding must also provide ``attend(x)`` when the head is tied.

Presets (``get_config(name, **overrides)``); parameter counts are exact
(``expected_param_count``, checked against ``jax.eval_shape`` in the tests):

=========  =====  =====  ======  =======  =======  ============  ==============
preset     d      heads  layers  seq_len  vocab    padded vocab  parameters
=========  =====  =====  ======  =======  =======  ============  ==============
``tiny``   64     4      2       64       256      256           0.12M (120,576)
``small``  512    8      6       256      8192     8192          23.2M (23,240,704)
``paper``  1024   16     8       512      50257    50304         152.8M (152,807,424)
=========  =====  =====  ======  =======  =======  ============  ==============

About the paper's "~168M parameters": the shape stated in Scalify (Balança et al. 2024,
d=1024, 16 heads, 8 layers, GPT-2 vocabulary 50257) gives 152.8M parameters with a tied
head (100.8M in the blocks, 51.5M in the token embedding, 0.5M position embedding at
seq_len 512; 153.3M at seq_len 1024) and 204.2M with an untied head. 168M is not reached by
that shape with the GPT-2 vocabulary; it would correspond e.g. to a 65536-token vocabulary
with a tied head (168.4M) or a 32000-token vocabulary with an untied head (167.4M at
seq_len 1024). We keep the paper's stated shape and GPT-2 vocabulary and report 152.8M.

Attention (``config.attention``): ``"softmax"`` is ``causal_attention`` below (masked
softmax in ``softmax_dtype``, the T x T probabilities materialised); ``"xla"`` and
``"cudnn"`` call ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
implementation=...)`` (``"cudnn"``: cuDNN flash attention, GPU only, bfloat16/float16 q/k/v,
head dim a multiple of 8 and <= 128 before Hopper, 256 from Hopper on; the ``paper`` model's
64 fits). ``"auto"`` (default) is ``"cudnn"`` on a GPU for a bfloat16 or float16 model
whose head dim fits, else ``"softmax"`` (CPU runs and float32 models). Under scalify the
cuDNN kernels are called on the scaled data (``scalify/rules/attention.py``): the q and k
scales go into the q and k data as the two halves of one power of two, so ``q' = dq *
sqrt(sq * sk)`` overflows float16 only where the geometric mean of the true ``|Q|`` and
``|K|`` does, i.e. not before plain float16 would. ``attention_fn``, and the FP8-saved attention of a
``saved_activations`` policy, take precedence over ``"auto"``.

The ``paper`` preset pads the embedding table to a multiple of 64 rows (50304) so that the
tied head's matmul has GPU/FP8-friendly dimensions (cuBLASLt FP8 GEMMs need multiples of
16); the logits are sliced back to ``vocab_size`` so padding is invisible to the caller.
The training step asks for the padded logits (``padded_logits=True``) and masks the padding
in the loss (``cross_entropy_loss(..., vocab_size=...)``): the backward pass of the slice
would pad the logits' gradient, a ``(batch, seq, vocab)`` copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "PRESETS",
    "PAPER_PARAM_COUNT",
    "get_config",
    "init_params",
    "param_shapes",
    "param_count",
    "expected_param_count",
    "cross_entropy_loss",
    "causal_attention",
    "dot_product_attention",
    "ATTENTIONS",
    "resolve_attention",
]

Dtype = Any


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    softmax_dtype: Dtype = jnp.float32,
    mask_value: float = float("-inf"),
) -> jax.Array:
    """Masked softmax attention, ``softmax(q k^T / sqrt(d_head), mask) v``.

    Args:
      q, k, v: ``(batch, seq, heads, d_head)``.
      mask: ``(seq_q, seq_k)`` bool, True where attention is allowed.
      softmax_dtype: dtype of the masked logits and the softmax (float32 by default, so a
        half-precision model keeps an accurate normalisation).
      mask_value: value given to masked logits through ``jnp.where`` (``-inf`` by default;
        any large negative value works because the diagonal is never masked).

    Returns:
      ``(batch, seq, heads, d_head)`` in the dtype of ``v``.
    """
    d_head = q.shape[-1]
    # Scaling q (not the T x T logits) keeps the multiply on the smaller tensor.
    q = q * jnp.asarray(1.0 / math.sqrt(d_head), dtype=q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    logits = logits.astype(softmax_dtype)
    logits = jnp.where(mask, logits, jnp.asarray(mask_value, dtype=softmax_dtype))
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


ATTENTIONS = ("auto", "softmax", "xla", "cudnn")


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, implementation: str | None
) -> jax.Array:
    """Causal ``jax.nn.dot_product_attention`` (``softmax(q k^T / sqrt(d_head)) v``) with the
    signature of ``causal_attention``. ``mask`` must be the causal mask of
    ``CausalSelfAttention``: it is not read, ``is_causal=True`` builds it (cuDNN then skips
    the masked blocks)."""
    del mask
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def resolve_attention(attention: str, dtype: Dtype, d_head: int, backend: str | None = None) -> str:
    """The attention ``"auto"`` stands for on ``backend`` (default: JAX's; see the module
    docstring); other values are checked against cuDNN's constraints and returned."""
    if attention not in ATTENTIONS:
        raise ValueError(f"Unknown attention {attention!r}; choose one of {ATTENTIONS}.")
    backend = backend or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    head_ok = d_head % 8 == 0 and d_head <= 128
    if attention == "auto":
        return "cudnn" if backend == "gpu" and half and head_ok else "softmax"
    if attention == "cudnn" and backend != "gpu":
        raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs a GPU; JAX runs on "
                         f"{backend}: use attention='xla', 'softmax' or 'auto'.")
    if attention == "xla" and backend == "cpu" and jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        raise ValueError(
            "attention='xla' with a float16 model does not compile on CPU: "
            "jax.nn.dot_product_attention asks float16 logits for the dot algorithm "
            "F16_F16_F32, which XLA:CPU lacks (plain JAX fails the same way); use "
            "attention='softmax' on CPU."
        )
    if attention == "cudnn" and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"attention='cudnn' needs a bfloat16 or float16 model (cuDNN flash attention), got "
            f"dtype {jnp.dtype(dtype).name}; use attention='xla' or 'softmax'."
        )
    if attention == "cudnn" and d_head % 8:
        raise ValueError(f"attention='cudnn' needs a head dim that is a multiple of 8, got {d_head}.")
    return attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters and injectable components of the GPT decoder.

    The config is frozen and hashable (it is a Flax module attribute); callables and classes
    in it are compared by identity.
    """

    vocab_size: int = 50257
    seq_len: int = 1024  # maximum sequence length (rows of the position embedding)
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    mlp_ratio: int = 4
    dtype: Dtype = jnp.float32  # computation dtype of the layers
    param_dtype: Dtype = jnp.float32  # storage dtype of the parameters
    use_bias: bool = True
    ln_epsilon: float = 1e-5
    gelu_approximate: bool = True  # tanh GELU (GPT-2) if True, exact erf GELU if False
    dropout_rate: float = 0.0
    init_std: float = 0.02
    tie_embeddings: bool = True  # head = token_embed.attend; else dense_cls(vocab, no bias)
    pad_vocab_multiple: int = 1  # embedding rows rounded up to this multiple
    softmax_dtype: Dtype = jnp.float32
    mask_value: float = float("-inf")
    scan_layers: bool = False  # nn.scan over the blocks (params stacked on a leading axis)
    remat: bool = False  # nn.remat (gradient checkpointing) on each block
    remat_policy: str | None = None  # name in jax.checkpoint_policies, e.g. "dots_saveable"
    # Injectable components (see the module docstring for the call signatures).
    dense_cls: Any = nn.Dense
    layernorm_cls: Any = nn.LayerNorm
    embed_cls: Any = nn.Embed
    activation: Callable[[jax.Array], jax.Array] | None = None  # default: GELU
    attention_fn: Callable[..., jax.Array] | None = None  # (q, k, v, mask) -> out
    attention: str = "auto"  # auto | softmax | xla | cudnn (module docstring)
    # Tensors saved for the backward pass in FP8 (COAT): None, or a
    # scalify.ops.saved_activations.ResidualPolicy or its string (e.g. "coat-attention").
    saved_activations: Any = None

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}.")
        if self.pad_vocab_multiple < 1:
            raise ValueError(f"pad_vocab_multiple must be >= 1, got {self.pad_vocab_multiple}.")
        if self.remat_policy is not None and not hasattr(jax.checkpoint_policies, self.remat_policy):
            raise ValueError(
                f"Unknown remat_policy {self.remat_policy!r}: use a name from jax.checkpoint_policies."
            )
        if self.saved_activations is not None:
            from scalify.ops.saved_activations import ResidualPolicy

            policy = ResidualPolicy.parse(self.saved_activations)  # raises on a bad spec
            if policy.attention and self.attention not in ("auto", "softmax"):
                raise ValueError(
                    f"saved_activations={self.saved_activations!r} saves the attention's "
                    f"tensors in FP8 (its own softmax attention); it cannot be combined with "
                    f"attention={self.attention!r}: use attention='auto'."
                )
        # A bad value or dtype raises here; the backend is checked when the model runs.
        resolve_attention(self.attention, self.dtype, self.d_head, backend="gpu")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_mlp(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return -(-self.vocab_size // m) * m

    def replace(self, **overrides) -> "GPTConfig":
        return dataclasses.replace(self, **overrides)

    def get_activation(self) -> Callable[[jax.Array], jax.Array]:
        if self.activation is not None:
            return self.activation
        return functools.partial(nn.gelu, approximate=self.gelu_approximate)

    def get_attention_fn(self) -> Callable[..., jax.Array]:
        if self.attention_fn is not None:
            return self.attention_fn
        policy = self.residual_policy()
        if policy is not None and policy.attention:
            from scalify.ops.saved_activations import fp8_saved_attention

            return functools.partial(
                fp8_saved_attention, qkv_spec=policy.attention_qkv,
                probs_spec=policy.attention_probs, softmax_dtype=self.softmax_dtype,
                mask_value=self.mask_value,
            )
        attention = resolve_attention(self.attention, self.dtype, self.d_head)
        if attention != "softmax":
            return functools.partial(dot_product_attention, implementation=attention)
        return functools.partial(
            causal_attention, softmax_dtype=self.softmax_dtype, mask_value=self.mask_value
        )

    def attention_name(self) -> str:
        """The attention the model runs: ``attention`` with ``"auto"`` resolved, a custom
        ``attention_fn``'s name, or the FP8-saved softmax of a ``saved_activations`` policy."""
        if self.attention_fn is not None:
            return getattr(self.attention_fn, "__name__", "custom")
        policy = self.residual_policy()
        if policy is not None and policy.attention:
            return "softmax (FP8-saved)"
        return resolve_attention(self.attention, self.dtype, self.d_head)

    def residual_policy(self):
        """The `ResidualPolicy` of ``saved_activations`` (None: nothing saved in FP8)."""
        if self.saved_activations is None:
            return None
        from scalify.ops.saved_activations import ResidualPolicy

        return ResidualPolicy.parse(self.saved_activations)

    def saved(self, layer: str, module: nn.Module, x: jax.Array) -> jax.Array:
        """``module(x)``, with ``x`` saved for the backward as the policy says for ``layer``."""
        policy = self.residual_policy()
        spec = None if policy is None else policy.spec(layer)
        if spec is None:
            return module(x)
        from scalify.ops.saved_activations import fp8_saved_module_call

        return fp8_saved_module_call(module, x, spec)

    def saved_activation(self) -> Callable[[jax.Array], jax.Array]:
        """The MLP activation, with its input saved as the policy says."""
        policy = self.residual_policy()
        spec = None if policy is None else policy.activation
        if spec is None:
            return self.get_activation()
        from scalify.ops.saved_activations import save_in_fp8

        return save_in_fp8(self.get_activation(), spec)


PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: a forward/backward in milliseconds; byte-level vocabulary.
    "tiny": dict(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2),
    # Minutes on one GPU; vocabulary of a small BPE trained on the corpus.
    "small": dict(vocab_size=8192, seq_len=256, d_model=512, n_heads=8, n_layers=6,
                  pad_vocab_multiple=64),
    # Scalify paper (Balança et al. 2024): d=1024, 16 heads, 8 layers, GPT-2 vocabulary.
    "paper": dict(vocab_size=50257, seq_len=512, d_model=1024, n_heads=16, n_layers=8,
                  pad_vocab_multiple=64),
}

# Exact parameter count of get_config("paper") (tied head, 50304 embedding rows, seq 512).
PAPER_PARAM_COUNT = 152_807_424


def get_config(name: str = "tiny", **overrides) -> GPTConfig:
    """Returns the preset ``name`` (``tiny``, ``small``, ``paper``) with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return GPTConfig(**{**PRESETS[name], **overrides})


def _dense(config: GPTConfig, features: int, name: str, std: float) -> nn.Module:
    return config.dense_cls(
        features,
        use_bias=config.use_bias,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.initializers.normal(stddev=std),
        name=name,
    )


def _layernorm(config: GPTConfig, name: str) -> nn.Module:
    return config.layernorm_cls(
        epsilon=config.ln_epsilon, dtype=config.dtype, param_dtype=config.param_dtype, name=name
    )


def _residual_std(config: GPTConfig) -> float:
    # GPT-2: projections into the residual stream are scaled by 1/sqrt(number of residual adds).
    return config.init_std / math.sqrt(2 * config.n_layers)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused qkv projection, masked softmax, output projection."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, _ = x.shape
        qkv = cfg.saved("linear", _dense(cfg, 3 * cfg.d_model, "qkv", cfg.init_std), x)
        qkv = qkv.reshape(b, t, 3, cfg.n_heads, cfg.d_head)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        pos = jnp.arange(t)
        mask = pos[:, None] >= pos[None, :]
        y = cfg.get_attention_fn()(q, k, v, mask)
        y = y.reshape(b, t, cfg.d_model)
        y = cfg.saved("linear", _dense(cfg, cfg.d_model, "out", _residual_std(cfg)), y)
        if cfg.dropout_rate > 0:
            y = nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
        return y


class MLP(nn.Module):
    """Position-wise feed-forward: ``proj(activation(fc(x)))``."""

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = cfg.saved("linear", _dense(cfg, cfg.d_mlp, "fc", cfg.init_std), x)
        h = cfg.saved_activation()(h)
        y = cfg.saved("linear", _dense(cfg, cfg.d_model, "proj", _residual_std(cfg)), h)
        if cfg.dropout_rate > 0:
            y = nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
        return y


class Block(nn.Module):
    """Pre-LayerNorm transformer block.

    ``__call__(x, _=None) -> (x, None)`` has the carry signature of ``nn.scan`` so the same
    module is used with and without ``scan_layers``.
    """

    config: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        cfg = self.config
        x = x + CausalSelfAttention(cfg, self.deterministic, name="attn")(
            cfg.saved("norm", _layernorm(cfg, "ln_1"), x))
        x = x + MLP(cfg, self.deterministic, name="mlp")(cfg.saved("norm", _layernorm(cfg, "ln_2"), x))
        return x, None


class GPT(nn.Module):
    """GPT-2-style decoder: ``tokens (batch, seq) int -> logits (batch, seq, vocab_size)``.

    With ``padded_logits=True`` the logits keep the padded vocabulary
    (``config.padded_vocab_size`` columns, the extra ones meaningless): give them to
    ``cross_entropy_loss(..., vocab_size=config.vocab_size)``, which masks the padding. The
    training step does so: slicing the logits costs a pad of their gradient in the backward
    pass, a full ``(batch, seq, vocab)`` copy.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True,
                 padded_logits: bool = False) -> jax.Array:
        cfg = self.config
        _, t = tokens.shape
        if t > cfg.seq_len:
            raise ValueError(f"Sequence length {t} exceeds config.seq_len={cfg.seq_len}.")
        embed_init = nn.initializers.normal(stddev=cfg.init_std)
        wte = cfg.embed_cls(
            cfg.padded_vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=embed_init, name="token_embed",
        )
        wpe = cfg.embed_cls(
            cfg.seq_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=embed_init, name="pos_embed",
        )
        x = wte(tokens) + wpe(jnp.arange(t))[None]
        if cfg.dropout_rate > 0:
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        block_cls = Block
        if cfg.remat:
            policy = getattr(jax.checkpoint_policies, cfg.remat_policy) if cfg.remat_policy else None
            block_cls = nn.remat(Block, prevent_cse=not cfg.scan_layers, policy=policy)
        if cfg.scan_layers:
            stack = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=cfg.n_layers,
            )
            x, _ = stack(cfg, deterministic, name="blocks")(x, None)
        else:
            for i in range(cfg.n_layers):
                x, _ = block_cls(cfg, deterministic, name=f"block_{i}")(x, None)

        x = cfg.saved("norm", _layernorm(cfg, "ln_f"), x)
        if cfg.tie_embeddings:
            logits = wte.attend(x)
        else:
            logits = cfg.dense_cls(
                cfg.padded_vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                kernel_init=nn.initializers.normal(stddev=cfg.init_std), name="lm_head",
            )(x)
        if cfg.padded_vocab_size != cfg.vocab_size and not padded_logits:
            logits = logits[..., : cfg.vocab_size]
        return logits


def init_params(config: GPTConfig, rng: jax.Array, batch_size: int = 1) -> Any:
    """Initialises the parameters of ``GPT(config)`` (``params`` collection only).

    The initialisation is jitted: one compilation instead of op-by-op dispatch, and the
    parameters are created directly on the device.
    """
    tokens = jnp.zeros((batch_size, config.seq_len), jnp.int32)
    return jax.jit(lambda key: GPT(config).init(key, tokens)["params"])(rng)


def param_shapes(config: GPTConfig) -> Any:
    """Parameter ``ShapeDtypeStruct`` tree via ``jax.eval_shape``: nothing is allocated."""
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def _is_scaled(x: Any) -> bool:
    return hasattr(x, "data") and hasattr(x, "scale") and not isinstance(x, np.ndarray)


def param_count(params: Any) -> int:
    """Number of scalar parameters in a tree of arrays, ``ShapeDtypeStruct`` or scaled arrays.

    A scaled array (anything with ``data`` and ``scale``) counts the elements of its data only.
    """
    leaves = jax.tree_util.tree_leaves(params, is_leaf=_is_scaled)
    return int(sum(math.prod((leaf.data if _is_scaled(leaf) else leaf).shape) for leaf in leaves))


def expected_param_count(config: GPTConfig) -> int:
    """Closed-form parameter count of ``GPT(config)`` with the default Flax layers.

    ``V_pad*d + seq*d`` (embeddings) ``+ L*(4d (two LayerNorms) + 3d^2 + d^2 + 2*r*d^2``
    (weights) ``+ [3d + d + r*d + d]`` (biases)) ``+ 2d`` (final LayerNorm) ``[+ d*V_pad]``
    (untied head).
    """
    d, r, n = config.d_model, config.mlp_ratio, config.n_layers
    per_layer = 4 * d + 4 * d * d + 2 * r * d * d
    if config.use_bias:
        per_layer += 3 * d + d + r * d + d
    total = config.padded_vocab_size * d + config.seq_len * d + n * per_layer + 2 * d
    if not config.tie_embeddings:
        total += d * config.padded_vocab_size
    return total


def cross_entropy_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None,
    *, vocab_size: int | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32.

    Args:
      logits: ``(..., vocab)`` in any float dtype; up-cast to float32 before the log-softmax.
      targets: ``(...)`` integer token ids.
      weights: optional ``(...)`` weights (e.g. a 0/1 mask); the mean is weighted.
      vocab_size: the real vocabulary when ``logits`` has padding columns (``GPT(...,
        padded_logits=True)``): columns ``>= vocab_size`` are set to ``-inf`` before the
        log-softmax, so the loss is that of ``logits[..., :vocab_size]`` and their gradient
        is 0. None: every column is a token.

    Returns:
      A float32 scalar: ``mean(-log_softmax(logits)[targets])``.

    Computed as ``logsumexp(logits) - logits[target]`` with the target's logit picked by an
    ``iota == target`` mask, not a gather: the gradient of a gather is a scatter into a dense
    float32 ``(..., vocab)`` zero tensor written and read in every step; the mask's gradient
    is a select that XLA fuses into the softmax's. The padding mask is a select too, for the
    same reason: slicing the padded logits instead makes the backward pass pad their gradient.
    """
    x = logits.astype(jnp.float32)
    column = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    if vocab_size is not None:
        if not 0 < vocab_size <= x.shape[-1]:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, {x.shape[-1]}] (the logits' last axis).")
        if vocab_size < x.shape[-1]:
            x = lax.select(column < vocab_size, x, jnp.full_like(x, -jnp.inf))
    is_target = column == targets[..., None].astype(jnp.int32)
    nll = jax.nn.logsumexp(x, axis=-1) - jnp.sum(lax.select(is_target, x, jnp.zeros_like(x)), axis=-1)
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
