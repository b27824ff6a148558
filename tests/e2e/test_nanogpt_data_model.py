"""NanoGPT example: data loading, tokenizers, batching and the Flax model (fast, CPU)."""

import functools
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _jaxpr_testing import equations
from experiments.nanogpt import data as D
from experiments.nanogpt import model as M

# A small WikiText-103 cut shipped with the tests (see its README.md).
WIKITEXT_DIR = Path(__file__).resolve().parents[1] / "data" / "wikitext"


# ----------------------------------------------------------------------------- data


def test_wikitext_loader_real_files(tmp_path):
    ds = D.load_dataset(WIKITEXT_DIR, tokenizer="byte", train_split="test", cache_dir=tmp_path)
    test_bytes = (WIKITEXT_DIR / "wiki.test.tokens").read_bytes()
    valid_bytes = (WIKITEXT_DIR / "wiki.valid.tokens").read_bytes()
    assert ds.vocab_size == 256
    assert ds.train_tokens.dtype == np.int32 and ds.valid_tokens.dtype == np.int32
    np.testing.assert_array_equal(ds.train_tokens, np.frombuffer(test_bytes, np.uint8))
    np.testing.assert_array_equal(ds.valid_tokens, np.frombuffer(valid_bytes, np.uint8))
    assert "wiki.test.tokens" in ds.description and "wiki.valid.tokens" in ds.description
    assert ds.tokenizer.decode(ds.valid_tokens[:200]).startswith(" \n = ")
    # "auto" falls back to the test split when there is no train split.
    auto = D.load_dataset(WIKITEXT_DIR, tokenizer="byte", train_split="auto", cache_dir=tmp_path)
    assert auto.info["train_file"] == "wiki.test.tokens"


def test_wikitext_missing_train_split_error_names_files():
    with pytest.raises(FileNotFoundError, match=r"wiki\.train\.tokens or wiki\.train\.raw.*train_split='test'"):
        D.load_dataset(WIKITEXT_DIR, tokenizer="byte", use_cache=False)


def test_wikitext_errors_and_raw_variant(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        D.read_wikitext(tmp_path / "nope")
    (tmp_path / "wiki.valid.raw").write_text("valid text\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"wiki\.train\.tokens or wiki\.train\.raw"):
        D.read_wikitext(tmp_path, ("train", "valid"))
    (tmp_path / "wiki.train.raw").write_text("train text " * 50 + "\n", encoding="utf-8")
    texts = D.read_wikitext(tmp_path, ("train", "valid"))
    assert texts["train"][0].name == "wiki.train.raw" and texts["valid"][1] == "valid text\n"
    with pytest.raises(FileNotFoundError, match=r"wiki\.train\.tokens \("):
        D.read_wikitext(tmp_path, ("train",), variant="tokens")
    ds = D.load_dataset(tmp_path, tokenizer="byte", use_cache=False)
    assert ds.info["train_file"] == "wiki.train.raw"


def test_bpe_training_and_cache_on_wikitext_slice(tmp_path):
    text = (WIKITEXT_DIR / "wiki.test.tokens").read_text(encoding="utf-8")[:200_000]
    tok = D.train_bpe_tokenizer(text, vocab_size=1024, cache_dir=tmp_path)
    assert tok.cache_path.exists() and tok.cache_path.name.startswith("bpe-1024-")
    assert tok.vocab_size == 1024 and tok.learned_vocab_size <= 1024
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 1024
    assert len(ids) < len(text) / 2  # merges were learned
    assert tok.decode(ids) == text  # byte-level: lossless
    # Encoding in chunks gives exactly the ids of one whole-text encode.
    np.testing.assert_array_equal(ids, tok.tokenizer.encode(text).ids)
    # Cache hit: same file, same mapping; another vocabulary size is another entry.
    again = D.train_bpe_tokenizer(text, vocab_size=1024, cache_dir=tmp_path)
    assert again.cache_path == tok.cache_path and again.cache_key == tok.cache_key
    np.testing.assert_array_equal(again.encode(text[:5000]), tok.encode(text[:5000]))
    other = D.train_bpe_tokenizer(text, vocab_size=512, cache_dir=tmp_path)
    assert other.cache_path != tok.cache_path
    assert len(list(tmp_path.glob("bpe-*.json"))) == 2


def test_byte_tokenizer_round_trip():
    tok = D.ByteTokenizer()
    text = "Scalify: x = data × scale, 2⁻⁷ — ok\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.vocab_size == 256 and ids.max() < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="256"):
        D.get_tokenizer("byte", vocab_size=1000)


def test_pydoc_corpus_and_dataset(tmp_path):
    train, valid = D.pydoc_splits()
    full = D.pydoc_corpus_text()
    assert train + valid == full and len(full) > 300_000
    assert 0.08 < len(valid) / len(full) < 0.12 and train.endswith("\n")
    assert D.pydoc_splits() == (train, valid)  # deterministic
    ds = D.load_dataset("pydoc", tokenizer="bpe", vocab_size=2048, cache_dir=tmp_path)
    assert ds.vocab_size == 2048 and ds.train_tokens.max() < 2048
    assert "pydoc_data.topics" in ds.description and ds.info["train_tokens"] == len(ds.train_tokens)
    assert ds.tokenizer.decode(ds.valid_tokens) == valid
    # Second load hits both caches (tokenizer json and token arrays).
    n_files = len(list(tmp_path.iterdir()))
    ds2 = D.load_dataset("pydoc", tokenizer="bpe", vocab_size=2048, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == n_files
    np.testing.assert_array_equal(ds2.train_tokens, ds.train_tokens)


def test_train_batches_shapes_shift_and_determinism():
    tokens = np.arange(1000, dtype=np.int32)
    x, y = D.sample_batch(tokens, 8, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])  # targets shifted by one
    np.testing.assert_array_equal(y, x + 1)  # contiguous windows of seq_len + 1
    it = D.train_batches(tokens, 4, 32, seed=3)
    batches = [next(it) for _ in range(5)]
    resumed = D.train_batches(tokens, 4, 32, seed=3, start_step=3)
    np.testing.assert_array_equal(next(resumed)[0], batches[3][0])
    assert not np.array_equal(batches[0][0], batches[1][0])
    # Every start is reachable, and windows never run past the end.
    x, y = D.sample_batch(np.arange(18, dtype=np.int32), 256, 16, np.random.default_rng(0))
    assert set(x[:, 0]) == {0, 1} and y.max() == 17
    with pytest.raises(ValueError, match="seq_len"):
        D.sample_batch(np.arange(10), 2, 10, np.random.default_rng(0))


def test_eval_batches_fixed_non_overlapping():
    tokens = np.arange(1000, dtype=np.int32) % 251
    batches = list(D.eval_batches(tokens, 4, 50))
    assert len(batches) == D.num_eval_batches(1000, 4, 50) == 4  # 19 windows -> 4 full batches
    starts = np.concatenate([x[:, 0] for x, _ in batches])
    np.testing.assert_array_equal(starts, (np.arange(16) * 50) % 251)
    for x, y in batches:
        assert x.shape == y.shape == (4, 50)
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    assert len(list(D.eval_batches(tokens, 4, 50, max_batches=2))) == 2
    again = list(D.eval_batches(tokens, 4, 50))
    np.testing.assert_array_equal(again[2][1], batches[2][1])


# ----------------------------------------------------------------------------- model


# CPU compiles dominate these tests: one parameter init is shared by all of them, and
# each distinct (config, shape) is jitted once.
TINY = M.get_config("tiny")
TINY_SCAN = M.get_config("tiny", scan_layers=True)


@functools.lru_cache(maxsize=None)
def _loop_params():
    return M.init_params(TINY, jax.random.PRNGKey(0))


def _stacked(loop_params, n_layers):
    """The loop model's per-layer parameters stacked into the ``scan_layers`` layout."""
    blocks = [loop_params[f"block_{i}"] for i in range(n_layers)]
    out = {k: v for k, v in loop_params.items() if not k.startswith("block_")}
    out["blocks"] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *blocks)
    return out


def _params(cfg):
    return _stacked(_loop_params(), cfg.n_layers) if cfg.scan_layers else _loop_params()


@functools.lru_cache(maxsize=None)
def _apply_fn(cfg):
    return jax.jit(lambda params, tokens: M.GPT(cfg).apply({"params": params}, tokens))


def _tokens(seed, shape=(2, 64)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), jnp.int32)


@pytest.mark.parametrize("cfg", [TINY, TINY_SCAN], ids=["loop", "scan"])
@jax.default_matmul_precision("highest")  # GPUs default to TF32 for float32 matmuls
def test_tiny_forward_shapes(cfg):
    params = _params(cfg)
    tokens = _tokens(0)
    logits = _apply_fn(cfg)(params, tokens)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and logits.dtype == jnp.float32
    assert M.param_count(params) == M.expected_param_count(cfg)
    shapes = M.param_shapes(cfg)  # the layout init would create
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(params)
    if cfg.scan_layers:
        assert shapes["blocks"]["attn"]["qkv"]["kernel"].shape == (cfg.n_layers, 64, 192)
        # Same weights, same function: scanning over layers changes nothing.
        np.testing.assert_allclose(logits, _apply_fn(TINY)(_loop_params(), tokens), rtol=1e-5, atol=1e-5)
    else:
        assert set(shapes) == {"block_0", "block_1", "token_embed", "pos_embed", "ln_f"}
        # Sequences shorter than seq_len run too, and see the same (causal) prefix.
        short = _apply_fn(cfg)(params, tokens[:, :10])
        assert short.shape == (2, 10, 256)
        np.testing.assert_allclose(short, logits[:, :10], rtol=1e-5, atol=1e-5)
    loss = M.cross_entropy_loss(logits, _tokens(1))
    assert loss.dtype == jnp.float32 and abs(float(loss) - np.log(256)) < 0.5


def test_scan_remat_gradients_match_loop():
    scan_cfg = TINY_SCAN.replace(remat=True, remat_policy="dots_saveable")
    tokens = _tokens(1, (2, 33))

    def loss(cfg, p):
        return M.cross_entropy_loss(M.GPT(cfg).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    l1, g1 = jax.jit(jax.value_and_grad(functools.partial(loss, TINY)))(_loop_params())
    l2, g2 = jax.jit(jax.value_and_grad(functools.partial(loss, scan_cfg)))(_params(scan_cfg))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    g1 = _stacked(g1, TINY.n_layers)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cfg", [TINY, TINY_SCAN], ids=["loop", "scan"])
def test_causal_mask(cfg):
    params, tokens = _params(cfg), _tokens(2)
    logits = _apply_fn(cfg)(params, tokens)
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
    logits2 = _apply_fn(cfg)(params, changed)
    np.testing.assert_array_equal(logits[0, :10], logits2[0, :10])  # the past is untouched
    assert not np.allclose(logits[0, 10:], logits2[0, 10:])  # the future does change
    np.testing.assert_array_equal(logits[1], logits2[1])  # other batch items are untouched


def test_gelu_variants():
    tokens = _tokens(3)
    tanh = _apply_fn(TINY)(_loop_params(), tokens)
    erf = _apply_fn(TINY.replace(gelu_approximate=False))(_loop_params(), tokens)
    assert not np.array_equal(tanh, erf)
    np.testing.assert_allclose(tanh, erf, atol=1e-2)


def test_attention_mask_value():
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32) for _ in range(3))
    mask = jnp.tril(jnp.ones((6, 6), bool))
    out_inf = M.causal_attention(q, k, v, mask)
    out_big = M.causal_attention(q, k, v, mask, mask_value=-1e9)
    np.testing.assert_allclose(out_inf, out_big, rtol=1e-6, atol=1e-6)
    # The first position attends to itself only.
    np.testing.assert_allclose(out_inf[:, 0], v[:, 0], rtol=1e-6)
    # Against a direct computation.
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out_inf, np.einsum("bhqk,bkhd->bqhd", p, v), rtol=1e-5, atol=1e-6)


def test_injected_layers_are_used():
    calls = {"dense": 0, "norm": 0, "act": 0}

    class CountingDense(nn.Dense):
        @nn.compact
        def __call__(self, x):
            calls["dense"] += 1
            return super().__call__(x)

    class CountingLayerNorm(nn.LayerNorm):
        @nn.compact
        def __call__(self, x, *args, **kwargs):
            calls["norm"] += 1
            return super().__call__(x, *args, **kwargs)

    def relu(x):
        calls["act"] += 1
        return jax.nn.relu(x)

    cfg = M.get_config("tiny", dense_cls=CountingDense, layernorm_cls=CountingLayerNorm, activation=relu,
                       tie_embeddings=False)
    tokens = jnp.zeros((1, 8), jnp.int32)
    shapes = M.param_shapes(cfg)
    assert shapes["lm_head"]["kernel"].shape == (64, 256)
    assert M.param_count(shapes) == M.expected_param_count(cfg)
    for key in calls:
        calls[key] = 0
    # Tracing is enough to see which layers the model builds (and it compiles nothing).
    logits = jax.eval_shape(lambda p, t: M.GPT(cfg).apply({"params": p}, t), shapes, tokens)
    assert logits.shape == (1, 8, 256)
    # Per layer: qkv, out, fc, proj; plus the untied head.
    assert calls == {"dense": 4 * cfg.n_layers + 1, "norm": 2 * cfg.n_layers + 1, "act": cfg.n_layers}


def test_half_precision_and_padded_vocab():
    cfg = TINY.replace(vocab_size=250, pad_vocab_multiple=64, dtype=jnp.bfloat16)
    assert cfg.padded_vocab_size == 256
    shapes = M.param_shapes(cfg)
    assert shapes["token_embed"]["embedding"].shape == (256, 64)
    assert shapes["token_embed"]["embedding"].dtype == jnp.float32
    bf16_shapes = M.param_shapes(cfg.replace(param_dtype=jnp.bfloat16))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(bf16_shapes))
    # Same parameter shapes as TINY: reuse its weights.
    tokens = jnp.zeros((2, 8), jnp.int32)
    logits = _apply_fn(cfg)(_loop_params(), tokens)
    assert logits.shape == (2, 8, 250) and logits.dtype == jnp.bfloat16
    assert M.cross_entropy_loss(logits, tokens).dtype == jnp.float32


def test_cross_entropy_loss_values():
    logits = jnp.log(jnp.array([[0.25, 0.25, 0.5], [0.1, 0.8, 0.1]], jnp.float16))
    targets = jnp.array([2, 0])
    expected = -(np.log(0.5) + np.log(0.1)) / 2
    np.testing.assert_allclose(M.cross_entropy_loss(logits, targets), expected, rtol=1e-3)
    np.testing.assert_allclose(M.cross_entropy_loss(logits, targets, jnp.array([1, 0])), -np.log(0.5), rtol=1e-3)


def test_cross_entropy_loss_matches_log_softmax_gather_and_needs_no_scatter():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 11)) * 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (3, 5)), jnp.float32)

    def reference(x, w=None):
        nll = -jnp.take_along_axis(jax.nn.log_softmax(x, -1), targets[..., None], -1)[..., 0]
        return jnp.mean(nll) if w is None else jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    for w in (None, weights):
        np.testing.assert_allclose(M.cross_entropy_loss(logits, targets, w), reference(logits, w), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(M.cross_entropy_loss)(logits, targets, w),
                                   jax.grad(reference)(logits, w), rtol=1e-5, atol=1e-8)
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(M.cross_entropy_loss))(logits, targets))
    assert "scatter" not in grad_jaxpr and "gather" not in grad_jaxpr



def test_cross_entropy_loss_on_padded_logits_masks_the_padding():
    rng = np.random.default_rng(1)
    padded = jnp.asarray(rng.normal(size=(2, 3, 16)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (2, 3)), jnp.int32)
    loss_padded = lambda x: M.cross_entropy_loss(x, targets, vocab_size=11)  # noqa: E731
    loss_sliced = lambda x: M.cross_entropy_loss(x[..., :11], targets)  # noqa: E731
    np.testing.assert_allclose(loss_padded(padded), loss_sliced(padded), rtol=1e-6)
    g_padded, g_sliced = jax.grad(loss_padded)(padded), jax.grad(loss_sliced)(padded)
    np.testing.assert_allclose(g_padded, g_sliced, rtol=1e-6, atol=1e-9)
    assert np.all(np.asarray(g_padded[..., 11:]) == 0)
    assert not re.search(r"\bpad\[", str(jax.make_jaxpr(jax.grad(loss_padded))(padded)))
    assert re.search(r"\bpad\[", str(jax.make_jaxpr(jax.grad(loss_sliced))(padded)))  # what it avoids
    np.testing.assert_allclose(M.cross_entropy_loss(padded, targets, vocab_size=16),
                               M.cross_entropy_loss(padded, targets), rtol=0)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="vocab_size"):
            M.cross_entropy_loss(padded, targets, vocab_size=bad)


def test_training_loss_uses_padded_logits_without_a_pad_in_the_backward():
    from experiments.nanogpt import step as S

    cfg = TINY.replace(vocab_size=250, pad_vocab_multiple=64)
    params = _loop_params()  # the padded table has TINY's 256 rows
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 250, (2, 9)), jnp.int32)
    loss_fn = S.make_loss_fn(cfg)
    sliced = M.cross_entropy_loss(M.GPT(cfg).apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])
    np.testing.assert_allclose(loss_fn(params, None, tokens[:, :-1], tokens[:, 1:]), sliced, rtol=1e-6)
    def logits_pads(fn):
        jaxpr = jax.make_jaxpr(jax.grad(fn))(params, None, tokens[:, :-1], tokens[:, 1:]).jaxpr
        return [e for e in equations(jaxpr) if e.primitive.name == "pad"
                and e.outvars[0].aval.shape[-1] == cfg.padded_vocab_size]

    assert not logits_pads(loss_fn)
    sliced_fn = lambda p, e, x, y: M.cross_entropy_loss(M.GPT(cfg).apply({"params": p}, x), y)  # noqa: E731
    assert logits_pads(sliced_fn)  # what the padded logits avoid


def test_paper_preset_param_count_without_allocation():
    cfg = M.get_config("paper")
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size) == (1024, 16, 8, 50257)
    shapes = M.param_shapes(cfg)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(shapes))
    assert M.param_count(shapes) == M.expected_param_count(cfg) == M.PAPER_PARAM_COUNT == 152_807_424
    assert shapes["token_embed"]["embedding"].shape == (50304, 1024)  # padded to a multiple of 64
    scanned = M.param_shapes(cfg.replace(scan_layers=True))
    assert M.param_count(scanned) == M.PAPER_PARAM_COUNT
    small = M.get_config("small")
    assert M.param_count(M.param_shapes(small)) == M.expected_param_count(small)


def test_presets_and_config_errors():
    assert set(M.PRESETS) == {"tiny", "small", "paper"}
    with pytest.raises(ValueError, match="Unknown model preset"):
        M.get_config("huge")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        M.get_config("tiny", d_model=66)
    with pytest.raises(ValueError, match="remat_policy"):
        M.get_config("tiny", remat_policy="nope")
    cfg = M.get_config("tiny")
    with pytest.raises(ValueError, match="exceeds"):
        M.GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.seq_len + 1), jnp.int32))
