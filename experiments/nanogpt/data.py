"""Offline language-modelling data for the NanoGPT example: corpora, tokenizers, batches.

Corpora (``load_dataset(name_or_dir, ...)``):

- ``"pydoc"``: text that ships with every CPython, the standard library's
  ``pydoc_data.topics`` (the help topics of the language reference, about 465k characters on
  Python 3.11). The topic texts are joined in sorted key order; the last ~10% (cut at a line
  boundary) is the validation split. No download, so the example runs on any fresh machine.
- a WikiText directory (Merity et al. 2017) holding ``wiki.train.tokens``,
  ``wiki.valid.tokens``, ``wiki.test.tokens`` or the raw variant ``wiki.{split}.raw``.
  ``train_split`` / ``valid_split`` choose the files; ``train_split="auto"`` uses the train
  split when present and otherwise the test split (the description says which).

Getting WikiText-103 on a connected machine (either way gives the three files; point
``--data-dir`` at the folder that holds them)::

    # the original archive (tokenized form, ~180 MB zip, ~540 MB train split)
    wget https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip
    unzip wikitext-103-v1.zip            # -> wikitext-103/wiki.{train,valid,test}.tokens

    # or from the Hugging Face hub with the `datasets` package (writes the .tokens form;
    # use "wikitext-103-raw-v1" and the ".raw" suffix for the raw variant)
    python -c "
    import datasets, pathlib
    out = pathlib.Path('wikitext-103'); out.mkdir(exist_ok=True)
    ds = datasets.load_dataset('Salesforce/wikitext', 'wikitext-103-v1')
    for split, name in [('train', 'train'), ('validation', 'valid'), ('test', 'test')]:
        (out / f'wiki.{name}.tokens').write_text(''.join(ds[split]['text']), encoding='utf-8')
    "

The validation and test splits of WikiText-2 and WikiText-103 are the same articles. With
only those two files (no train split), small runs train on ``test`` and evaluate on
``valid`` (``train_split="auto"`` does so; say so in the results). The tests use a small
cut of both, the first six articles, in ``tests/data/wikitext/``.

Tokenizers (everything offline, nothing from a model hub):

- ``"byte"``: UTF-8 bytes, vocabulary 256, no training.
- ``"bpe"``: a byte-level BPE (GPT-2 pre-tokenisation, ``<|endoftext|>`` special token)
  trained with the ``tokenizers`` library on the training split only; ``vocab_size`` 8192 by
  default (50257 for the paper's GPT-2-size vocabulary). The tokenizer JSON is cached under
  ``cache_dir`` keyed by a hash of the training text and the vocabulary size, and the encoded
  token arrays are cached as ``.npy`` keyed by the tokenizer and the text.

Batches are NumPy int32 ``(inputs, targets)`` pairs of shape ``(batch, seq_len)`` with
``targets = inputs`` shifted by one token. Training batches are random contiguous windows of
``seq_len + 1`` tokens; the windows of step ``s`` come from ``np.random.default_rng((seed,
s))``, so a resumed run continues the same stream from ``start_step``. Evaluation batches are
fixed non-overlapping windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "Dataset",
    "WIKITEXT_SPLITS",
    "DEFAULT_BPE_VOCAB_SIZE",
    "default_cache_dir",
    "pydoc_corpus_text",
    "pydoc_splits",
    "find_wikitext_files",
    "read_wikitext",
    "train_bpe_tokenizer",
    "get_tokenizer",
    "encode_text",
    "load_dataset",
    "sample_batch",
    "train_batches",
    "eval_batches",
    "num_eval_batches",
]

WIKITEXT_SPLITS = ("train", "valid", "test")
_WIKITEXT_VARIANTS = {"tokens": ".tokens", "raw": ".raw"}
DEFAULT_BPE_VOCAB_SIZE = 8192
_BPE_SPECIAL_TOKENS = ("<|endoftext|>",)
# Bumped when the tokenizer recipe or the token-cache format changes (invalidates caches).
_CACHE_VERSION = "v1"
# Cut points that leave the GPT-2 pre-tokenisation unchanged (see _text_chunks).
_CUT = re.compile(r"(?<=\S)\n(?=\S)|\n(?= \S)")


# ----------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What the example needs from a tokenizer."""

    name: str  # short description, e.g. "byte" or "bpe-8192"
    vocab_size: int  # size of the model's vocabulary (ids are in [0, vocab_size))

    def encode(self, text: str) -> np.ndarray: ...  # int32 ids

    def decode(self, ids: Iterable[int]) -> str: ...

    @property
    def cache_key(self) -> str: ...  # identifies the mapping text -> ids


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no training."""

    name = "byte"
    vocab_size = 256
    cache_key = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return np.asarray(list(ids), np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """A byte-level BPE from the ``tokenizers`` library (GPT-2 style pre-tokenisation).

    ``vocab_size`` is the nominal size the model uses; a small corpus may learn fewer merges
    (``learned_vocab_size``), in which case the top ids are never produced.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.learned_vocab_size = int(tokenizer.get_vocab_size())
        self.vocab_size = int(vocab_size or self.learned_vocab_size)
        if self.vocab_size < self.learned_vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the tokenizer's "
                f"{self.learned_vocab_size} tokens."
            )
        self.name = f"bpe-{self.vocab_size}"
        self._json = tokenizer.to_str()

    @classmethod
    def train(cls, text: str, vocab_size: int = DEFAULT_BPE_VOCAB_SIZE, min_frequency: int = 2):
        """Trains a byte-level BPE with ``vocab_size`` tokens (special token included) on ``text``."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise ValueError(f"A byte-level BPE needs vocab_size >= 257 (256 bytes + 1 special), got {vocab_size}.")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(_BPE_SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_text_chunks(text), trainer=trainer)
        return cls(tok, vocab_size)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)), vocab_size)

    def save(self, path: str | Path) -> None:
        _atomic_write_text(Path(path), self._json)

    @property
    def cache_key(self) -> str:
        return "bpe-" + hashlib.sha256(self._json.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        chunks = list(_text_chunks(text, chunk_chars=1 << 16))
        if not chunks:
            return np.zeros((0,), np.int32)
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(chunks, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, np.int32) for e in encodings])

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) < self.learned_vocab_size]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, learned={self.learned_vocab_size})"


def _text_chunks(text: str, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Splits ``text`` into pieces of about ``chunk_chars``, cut only where encoding the pieces
    gives exactly the ids of encoding the whole text.

    The GPT-2 pre-tokenisation splits a whitespace run ``W`` before a non-space character into
    ``W[:-1]`` and ``W[-1]``, the last character joining the next word when it is a space. So
    a cut is exact after a newline with non-space characters on both sides, or after a newline
    followed by one space and a non-space character (WikiText's `` \\n = Heading``).
    """
    start, n = 0, len(text)
    while start < n:
        end = n
        if start + chunk_chars < n:
            m = _CUT.search(text, start + chunk_chars)
            end = n if m is None else m.end()
        yield text[start:end]
        start = end


# ----------------------------------------------------------------------------- caching


def default_cache_dir() -> Path:
    """``$SCALIFY_NANOGPT_CACHE`` or ``$XDG_CACHE_HOME/scalify-nanogpt`` (``~/.cache/...``)."""
    env = os.environ.get("SCALIFY_NANOGPT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scalify-nanogpt"


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8", suffix=".tmp") as f:
        f.write(text)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".npy.tmp") as f:
        np.save(f, array)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)


def train_bpe_tokenizer(
    text: str,
    vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    max_train_chars: int | None = None,
) -> BPETokenizer:
    """Trains (or loads from the cache) a byte-level BPE on ``text``.

    Args:
      text: the training text (the training split only).
      vocab_size: number of tokens, special token included.
      cache_dir: where ``bpe-{vocab_size}-{hash}.json`` lives (``default_cache_dir()`` if None).
      use_cache: read/write the cache.
      max_train_chars: train on the first ``max_train_chars`` characters only (cut at a line
        boundary), to bound the training time on a large corpus.

    Returns:
      The tokenizer; its ``cache_path`` attribute is the JSON file when cached.
    """
    if max_train_chars is not None and max_train_chars < len(text):
        cut = text.find("\n", max_train_chars)
        text = text[: (max_train_chars if cut < 0 else cut + 1)]
    key = _sha(_CACHE_VERSION, "bpe", str(vocab_size), text)
    path = Path(cache_dir or default_cache_dir()) / f"bpe-{vocab_size}-{key}.json"
    if use_cache and path.exists():
        tok = BPETokenizer.from_file(path, vocab_size)
    else:
        tok = BPETokenizer.train(text, vocab_size)
        if use_cache:
            tok.save(path)
    tok.cache_path = path if use_cache else None
    return tok


def get_tokenizer(
    kind: str | Tokenizer,
    train_text: str | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    max_train_chars: int | None = None,
) -> Tokenizer:
    """``"byte"``, ``"bpe"`` (trained on ``train_text``) or a ready tokenizer object."""
    if not isinstance(kind, str):
        return kind
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"The byte tokenizer has vocab_size 256, got vocab_size={vocab_size}.")
        return ByteTokenizer()
    if kind == "bpe":
        if train_text is None:
            raise ValueError("The BPE tokenizer needs train_text to learn its merges.")
        return train_bpe_tokenizer(
            train_text, vocab_size or DEFAULT_BPE_VOCAB_SIZE, cache_dir, use_cache, max_train_chars
        )
    raise ValueError(f"Unknown tokenizer {kind!r}: use 'byte', 'bpe' or a tokenizer object.")


def encode_text(
    tokenizer: Tokenizer, text: str, cache_dir: str | Path | None = None, use_cache: bool = True
) -> np.ndarray:
    """``tokenizer.encode(text)`` as int32, cached as ``.npy`` (uint16 when the vocab fits)."""
    path = Path(cache_dir or default_cache_dir()) / f"tokens-{_sha(_CACHE_VERSION, tokenizer.cache_key, text)}.npy"
    if use_cache and path.exists():
        return np.load(path).astype(np.int32)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if use_cache:
        _atomic_save_npy(path, ids.astype(np.uint16) if tokenizer.vocab_size <= 1 << 16 else ids)
    return ids


# ----------------------------------------------------------------------------- corpora


def pydoc_corpus_text() -> str:
    """The help topics of ``pydoc_data.topics`` (shipped with CPython), joined in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip("\n") for k in sorted(topics)) + "\n"


def pydoc_splits(valid_fraction: float = 0.1) -> tuple[str, str]:
    """(train, valid) texts of the pydoc corpus: the last ``valid_fraction``, cut after a newline."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}.")
    text = pydoc_corpus_text()
    cut = text.find("\n", int(len(text) * (1.0 - valid_fraction)))
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut], text[cut:]


def find_wikitext_files(data_dir: str | Path) -> dict[str, Path]:
    """The WikiText split files present in ``data_dir``: ``{split: path}``, ``.tokens`` preferred."""
    data_dir = Path(data_dir)
    found = {}
    for split in WIKITEXT_SPLITS:
        for suffix in _WIKITEXT_VARIANTS.values():
            path = data_dir / f"wiki.{split}{suffix}"
            if path.is_file():
                found[split] = path
                break
    return found


def read_wikitext(
    data_dir: str | Path, splits: Iterable[str] = ("train", "valid"), variant: str = "auto"
) -> dict[str, tuple[Path, str]]:
    """Reads WikiText splits: ``{split: (path, text)}``.

    Args:
      data_dir: directory with ``wiki.{train,valid,test}.tokens`` (or ``.raw``).
      splits: which of ``train``, ``valid``, ``test`` to read.
      variant: ``"tokens"``, ``"raw"`` or ``"auto"`` (``.tokens`` if present, else ``.raw``).

    Raises:
      FileNotFoundError: naming the directory and each missing file.
    """
    data_dir = Path(data_dir)
    if variant not in ("auto", *_WIKITEXT_VARIANTS):
        raise ValueError(f"variant must be 'auto', 'tokens' or 'raw', got {variant!r}.")
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"WikiText directory {data_dir} does not exist. Point it at a folder holding "
            "wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens (or the .raw files); "
            "see the docstring of experiments/nanogpt/data.py to download WikiText-103."
        )
    suffixes = list(_WIKITEXT_VARIANTS.values()) if variant == "auto" else [_WIKITEXT_VARIANTS[variant]]
    out, missing = {}, []
    for split in splits:
        if split not in WIKITEXT_SPLITS:
            raise ValueError(f"Unknown WikiText split {split!r}; use one of {WIKITEXT_SPLITS}.")
        candidates = [data_dir / f"wiki.{split}{s}" for s in suffixes]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            missing.append(" or ".join(p.name for p in candidates))
        else:
            out[split] = (path, path.read_text(encoding="utf-8"))
    if missing:
        present = sorted(p.name for p in data_dir.iterdir() if p.name.startswith("wiki."))
        hint = ""
        if "train" in splits and "train" not in out and "test" in find_wikitext_files(data_dir):
            hint = (" This looks like the validation/test sample: pass train_split='test' (or "
                    "'auto') to train on the test split.")
        raise FileNotFoundError(
            f"WikiText directory {data_dir} lacks {', '.join(missing)} "
            f"(found: {', '.join(present) or 'no wiki.* files'}).{hint}"
        )
    return out


# ----------------------------------------------------------------------------- batches


def _check_window(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"Need at least seq_len + 1 = {seq_len + 1} tokens, have {len(tokens)}.")


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random contiguous windows of ``seq_len + 1`` tokens -> int32 ``(inputs, targets)``.

    ``inputs[b] = tokens[s_b : s_b + seq_len]`` and ``targets[b] = tokens[s_b + 1 : s_b +
    seq_len + 1]`` with ``s_b`` uniform over all valid starts.
    """
    _check_window(tokens, seq_len)
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    windows = np.asarray(tokens)[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def train_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless training batches; step ``s`` draws from ``np.random.default_rng((seed, s))``.

    Resuming at ``start_step`` yields exactly the batches an uninterrupted run would have.
    """
    _check_window(tokens, seq_len)
    step = start_step
    while True:
        yield sample_batch(tokens, batch_size, seq_len, np.random.default_rng((seed, step)))
        step += 1


def num_eval_batches(num_tokens: int, batch_size: int, seq_len: int) -> int:
    """Number of full batches ``eval_batches`` yields for ``num_tokens`` tokens."""
    return max(num_tokens - 1, 0) // seq_len // batch_size


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Fixed non-overlapping windows, in order: window ``i`` is ``tokens[i*seq_len : (i+1)*seq_len + 1]``.

    Only full batches are yielded (one compiled shape); the tail of fewer than
    ``batch_size`` windows is dropped. ``max_batches`` caps the number of batches.
    """
    _check_window(tokens, seq_len)
    n = num_eval_batches(len(tokens), batch_size, seq_len)
    if max_batches is not None:
        n = min(n, max_batches)
    offsets = np.arange(seq_len + 1)
    for b in range(n):
        starts = (b * batch_size + np.arange(batch_size)) * seq_len
        windows = np.asarray(tokens)[starts[:, None] + offsets].astype(np.int32)
        yield windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- datasets


@dataclasses.dataclass
class Dataset:
    """Tokenised train/validation splits and the tokenizer that made them."""

    train_tokens: np.ndarray  # int32 ids, shape=(n_train,)
    valid_tokens: np.ndarray  # int32 ids, shape=(n_valid,)
    tokenizer: Tokenizer
    vocab_size: int  # the model's vocabulary size
    description: str  # one line for logs and result files
    info: dict = dataclasses.field(default_factory=dict)  # JSON-serialisable details

    def train_batches(self, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0):
        return train_batches(self.train_tokens, batch_size, seq_len, seed, start_step)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int | None = None):
        return eval_batches(self.valid_tokens, batch_size, seq_len, max_batches)


def _describe_tokenizer(tok: Tokenizer) -> str:
    if isinstance(tok, BPETokenizer):
        extra = "" if tok.learned_vocab_size == tok.vocab_size else f", {tok.learned_vocab_size} learned"
        return f"byte-level BPE (vocab {tok.vocab_size}{extra}, trained on the train split)"
    return f"{tok.name} (vocab {tok.vocab_size})"


def load_dataset(
    name_or_dir: str | Path = "pydoc",
    *,
    tokenizer: str | Tokenizer = "bpe",
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    train_split: str = "train",
    valid_split: str = "valid",
    variant: str = "auto",
    valid_fraction: float = 0.1,
    max_train_chars: int | None = None,
    bpe_max_train_chars: int | None = None,
) -> Dataset:
    """Loads and tokenises a corpus.

    Args:
      name_or_dir: ``"pydoc"`` (embedded corpus) or a WikiText directory.
      tokenizer: ``"bpe"`` (trained on the train split, cached), ``"byte"`` or a tokenizer.
      vocab_size: BPE vocabulary (default 8192; 50257 for the paper); must be 256 or None
        for ``"byte"``.
      cache_dir: tokenizer and token cache (``default_cache_dir()`` if None).
      use_cache: read/write the caches.
      train_split, valid_split: WikiText files to use (``train``/``valid``/``test``);
        ``train_split="auto"`` takes ``train`` if present, else ``test``.
      variant: WikiText ``"tokens"``, ``"raw"`` or ``"auto"``.
      valid_fraction: validation share of the pydoc corpus.
      max_train_chars: truncate the training text (at a line boundary) before anything else,
        for quick runs on a large corpus.
      bpe_max_train_chars: learn the BPE on at most this many characters of the training text
        (the whole training text is still tokenised).

    Returns:
      A ``Dataset``; ``description`` states the corpus, the files used and the tokenizer.
    """
    if str(name_or_dir) == "pydoc":
        train_text, valid_text = pydoc_splits(valid_fraction)
        import platform

        source = f"pydoc_data.topics of Python {platform.python_version()}"
        train_name, valid_name = f"first {1 - valid_fraction:.0%}", f"last {valid_fraction:.0%}"
        info = {"corpus": "pydoc", "python": platform.python_version(), "valid_fraction": valid_fraction}
    else:
        data_dir = Path(name_or_dir)
        if train_split == "auto":
            train_split = "train" if "train" in find_wikitext_files(data_dir) else "test"
        if train_split == valid_split:
            raise ValueError(f"train_split and valid_split are both {train_split!r}.")
        texts = read_wikitext(data_dir, (train_split, valid_split), variant)
        (train_path, train_text), (valid_path, valid_text) = texts[train_split], texts[valid_split]
        source = f"WikiText in {data_dir}"
        train_name, valid_name = train_path.name, valid_path.name
        info = {"corpus": "wikitext", "data_dir": str(data_dir), "train_file": train_path.name,
                "valid_file": valid_path.name}
    if max_train_chars is not None and max_train_chars < len(train_text):
        cut = train_text.find("\n", max_train_chars)
        train_text = train_text[: (max_train_chars if cut < 0 else cut + 1)]
        train_name += f" (first {len(train_text):,} chars)"

    tok = get_tokenizer(tokenizer, train_text, vocab_size, cache_dir, use_cache, bpe_max_train_chars)
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise ValueError(f"Tokenizer {tok!r} has vocab_size {tok.vocab_size}, asked for {vocab_size}.")
    train_tokens = encode_text(tok, train_text, cache_dir, use_cache)
    valid_tokens = encode_text(tok, valid_text, cache_dir, use_cache)
    description = (
        f"{source}: train={train_name} ({len(train_text):,} chars, {len(train_tokens):,} tokens), "
        f"valid={valid_name} ({len(valid_text):,} chars, {len(valid_tokens):,} tokens); "
        f"tokenizer: {_describe_tokenizer(tok)}"
    )
    info.update(
        train_split=train_name, valid_split=valid_name, train_chars=len(train_text),
        valid_chars=len(valid_text), train_tokens=int(len(train_tokens)),
        valid_tokens=int(len(valid_tokens)), tokenizer=tok.name, vocab_size=tok.vocab_size,
    )
    return Dataset(train_tokens, valid_tokens, tok, tok.vocab_size, description, info)


def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.nanogpt.data [pydoc|DIR]``: tokenise and print statistics."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="?", default="pydoc", help="'pydoc' or a WikiText directory")
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "byte"])
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--train-split", default="train", help="train, test or auto (WikiText only)")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)
    ds = load_dataset(args.data, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      cache_dir=args.cache_dir, train_split=args.train_split)
    print(ds.description)
    print(json.dumps(ds.info, indent=1))
    print("sample:", repr(ds.tokenizer.decode(ds.valid_tokens[:64])))


if __name__ == "__main__":
    main(sys.argv[1:])
