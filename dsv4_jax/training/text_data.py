"""Training text for drafters: files -> token streams (train / held-out) -> deterministic, seeded windows.

Inputs (checked before any work, `DataError` names the file and line):
    .txt      one document per file (UTF-8)
    .jsonl    one document per line, a JSON object with a string "text" field
    .npy      pre-tokenized: a 1-D integer array (one document) or 2-D (one document per row)
    a directory: every such file under it, sorted

Text is tokenized with a `tokenizer.json` (the `tokenizers` package, extra `dsv4_jax[tokenizers]`) or the
bundled byte tokenizer; each document becomes [BOS] + its ids (BOS when the model has one), and the
documents of a split are concatenated into one int32 stream. Held-out documents: a fixed fraction chosen
by a hash of (file name, document index), like `training.data.is_heldout`; when that leaves either side
shorter than it needs (few, long documents), the last fraction of the stream is held out instead.

Windows: `window_starts(n, length, count, seed, step)` draws from a generator seeded by (seed, step), so the
windows of step i do not depend on the steps before it: a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Iterator

import numpy as np

from ..config import ModelConfig
from ..demo import ByteTokenizer

SUFFIXES = (".txt", ".jsonl", ".npy")


class DataError(ValueError):
    """Unusable training data or tokenizer (missing, empty, malformed, or not matching the model)."""


# ---- tokenizers --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """What tokenizing a corpus needs: encode(text) -> ids (no BOS), the vocabulary size, a name for logs."""

    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]
    token_to_id: Callable[[str], int | None] = lambda _t: None
    id_to_token: Callable[[int], str | None] = lambda _i: None


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer("byte", ByteTokenizer.vocab_size, lambda t: ByteTokenizer().encode(t, add_bos=False))


def hf_tokenizer(path: str) -> TextTokenizer:
    """A `tokenizer.json` (or a directory holding one) through the `tokenizers` package."""
    tj = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(tj):
        raise DataError(f"--tokenizer {path!r}: no such file (expected a tokenizer.json or a directory with one)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(f"{tj} needs the `tokenizers` package: pip install 'dsv4_jax[tokenizers]'") from None
    try:
        tok = Tokenizer.from_file(tj)
    except Exception as e:  # noqa: BLE001 - the package raises a bare Exception for unreadable files
        raise DataError(f"{tj}: not a readable tokenizer.json ({e})") from None
    return TextTokenizer(tj, tok.get_vocab_size(with_added_tokens=True),
                         lambda t: tok.encode(t, add_special_tokens=False).ids, tok.token_to_id, tok.id_to_token)


def resolve_tokenizer(spec: str | None, model_dir: str | None, config: ModelConfig) -> TextTokenizer:
    """--tokenizer: 'byte', a tokenizer.json path, or None (MODEL/tokenizer.json, else bytes for a byte model)."""
    if spec == "byte":
        return byte_tokenizer()
    if spec is not None:
        return hf_tokenizer(spec)
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return hf_tokenizer(os.path.join(model_dir, "tokenizer.json"))
    if config.vocab_size == ByteTokenizer.vocab_size:
        return byte_tokenizer()
    raise DataError(f"the model's vocabulary has {config.vocab_size} tokens and no tokenizer.json was found next "
                    "to it: pass --tokenizer PATH/tokenizer.json (or pre-tokenized .npy data)")


# Padded vocabularies (rows for hardware alignment, reserved ids) are common: DeepSeek-V4 has 129280 rows for
# a tokenizer of ~128.8K tokens. A tokenizer using less than this share of the rows is for another model.
MIN_VOCAB_SHARE = 0.9


def check_tokenizer(tok: TextTokenizer, config: ModelConfig) -> None:
    """The tokenizer must fit the embedding and look like the model's own (DataError otherwise)."""
    V = config.vocab_size
    if tok.name == "byte":
        if V != ByteTokenizer.vocab_size:
            raise DataError(f"the byte tokenizer has {ByteTokenizer.vocab_size} tokens but the model's vocabulary "
                            f"has {V}: pass the model's --tokenizer tokenizer.json")
        return
    if tok.vocab_size > V:
        raise DataError(f"tokenizer {tok.name} has {tok.vocab_size} tokens, more than the model's vocabulary ({V}): "
                        "it is not this model's tokenizer")
    if tok.vocab_size < MIN_VOCAB_SHARE * V:
        raise DataError(f"tokenizer {tok.name} has {tok.vocab_size} tokens for a model with {V} embedding rows "
                        f"(less than {MIN_VOCAB_SHARE:.0%}): it is not this model's tokenizer")
    for what, tid in (("BOS", config.bos_token_id), ("EOS", config.eos_token_id)):
        if tid is not None and tok.id_to_token(int(tid)) is None:
            raise DataError(f"tokenizer {tok.name} has no token with the model's {what} id {tid}")


# ---- files -> documents ------------------------------------------------------------------------------

def expand_paths(paths: list[str]) -> list[str]:
    """Files of the given paths (directories: every supported file under them, sorted). DataError when unusable."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith(SUFFIXES))
            if not found:
                raise DataError(f"data directory {p!r} holds no {'/'.join(SUFFIXES)} files")
            out += found
        elif not os.path.exists(p):
            raise DataError(f"data file {p!r} does not exist")
        elif not p.endswith(SUFFIXES):
            raise DataError(f"data file {p!r}: unsupported type (use {', '.join(SUFFIXES)})")
        else:
            out.append(p)
    if not out:
        raise DataError("no data files given")
    return out


def needs_tokenizer(files: list[str]) -> bool:
    return any(not f.endswith(".npy") for f in files)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _jsonl_texts(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"{path}:{n}: expected a JSON object with a string \"text\" field")
            yield rec["text"]


def _npy_docs(path: str, vocab_size: int) -> list[np.ndarray]:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})") from None
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim not in (1, 2):
        raise DataError(f"{path}: pre-tokenized data must be a 1-D or 2-D integer array, got {arr.dtype} "
                        f"with shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise DataError(f"{path}: token ids must be in [0, {vocab_size}) for this model, found "
                        f"{int(arr.min())}..{int(arr.max())}")
    return [np.asarray(arr, np.int32)] if arr.ndim == 1 else [np.asarray(r, np.int32) for r in arr]


def documents(path: str, tok: TextTokenizer | None, vocab_size: int) -> list[np.ndarray]:
    """The token ids of each document of one file (no BOS yet)."""
    if path.endswith(".npy"):
        return _npy_docs(path, vocab_size)
    texts = [_read_text(path)] if path.endswith(".txt") else list(_jsonl_texts(path))
    return [np.asarray(tok.encode(t), np.int32) for t in texts]


# ---- documents -> streams ------------------------------------------------------------------------------

@dataclasses.dataclass
class Corpus:
    train: np.ndarray        # int32 [N] token stream
    heldout: np.ndarray      # int32 [M]
    info: dict


def is_heldout(key: str, frac: float) -> bool:
    """A fixed share `frac` of documents, chosen by sha1 of their key (file name + index)."""
    h = int(hashlib.sha1(key.encode()).hexdigest()[:12], 16) / 16 ** 12
    return h < frac


def _stream(docs: list[np.ndarray], bos: int | None) -> np.ndarray:
    parts = [np.concatenate([[bos], d]).astype(np.int32) if bos is not None else d for d in docs if len(d)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def build_corpus(files: list[str], tok: TextTokenizer | None, config: ModelConfig, *, heldout_files=None,
                 heldout_frac: float = 0.05, min_train: int, min_heldout: int) -> Corpus:
    """Tokenize every file; split off held-out documents. DataError when a side is too short.

    min_train: tokens the training windows need (seq_len + 1); min_heldout: what the evaluation needs.
    """
    bos = config.bos_token_id
    train_docs, held_docs, n_docs = [], [], 0
    for f in files:
        for i, d in enumerate(documents(f, tok, config.vocab_size)):
            n_docs += 1
            key = f"{os.path.basename(f)}:{i}"
            (held_docs if heldout_files is None and is_heldout(key, heldout_frac) else train_docs).append(d)
    if heldout_files is not None:
        held_docs = [d for f in heldout_files for d in documents(f, tok, config.vocab_size)]
    train, held = _stream(train_docs, bos), _stream(held_docs, bos)
    split = "given files" if heldout_files is not None else f"documents by hash ({heldout_frac:g})"
    if heldout_files is None and (len(held) < min_heldout or len(train) < min_train):
        whole = _stream(train_docs + held_docs, bos)     # few, long documents: hold out the stream's tail
        cut = len(whole) - max(min_heldout, int(round(heldout_frac * len(whole))))
        train, held, split = whole[:cut], whole[cut:], f"stream tail ({heldout_frac:g}, at least {min_heldout})"
    total = len(train) + len(held)
    if total == 0:
        raise DataError(f"the data ({len(files)} file(s)) holds no tokens")
    if len(train) < min_train:
        raise DataError(f"the training split has {len(train)} tokens, fewer than one window needs ({min_train}); "
                        "give more data or a shorter --seq-len")
    if len(held) < min_heldout:
        raise DataError(f"the held-out split has {len(held)} tokens, fewer than the evaluation needs "
                        f"({min_heldout}); give more data, --heldout-data, or fewer/shorter eval prompts")
    info = {"files": [os.path.abspath(f) for f in files], "documents": n_docs, "train_tokens": int(len(train)),
            "heldout_tokens": int(len(held)), "heldout_split": split,
            "heldout_files": None if heldout_files is None else [os.path.abspath(f) for f in heldout_files],
            "tokenizer": None if tok is None else tok.name, "bos": bos}
    return Corpus(train=train, heldout=held, info=info)


# ---- windows ---------------------------------------------------------------------------------------

def window_starts(n_tokens: int, length: int, count: int, seed: int, step: int) -> np.ndarray:
    """`count` window starts in [0, n_tokens − length] for training step `step` (seeded by (seed, step))."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - length + 1, count)


def windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 [len(starts), length]."""
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def prompt_windows(stream: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """n evaluation prompts [n, length] from the held-out stream, starting at distinct seeded offsets."""
    rng = np.random.default_rng([seed, 2 ** 31 - 1])
    hi = len(stream) - length
    starts = rng.choice(hi + 1, size=n, replace=hi + 1 < n) if hi >= 0 else np.zeros((n,), np.int64)
    return windows(stream, np.sort(starts), length)
