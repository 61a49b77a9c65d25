"""Byte-level text data: a corpus split by file, fixed-length windows, per-learner grain shards.

The default corpus is the Python standard library source of the running interpreter: real text,
present on every machine, no download. Any text file or folder can be used through `data.path`.

Rules a run relies on:
  * Train/validation split is by file, decided by a hash of the file's path relative to the
    corpus root, so it is the same on every machine and does not shift when files are added.
    When the hash holds out no file of a small folder, the file with the lowest hash is held
    out (and when it holds out every file, the one with the highest trains).
    A single-file corpus is split by bytes instead: its last `val_fraction` is validation.
    JSONL, Parquet and other structured files are not text: `data.prepare` tokenizes them.
  * Training windows are cut every `seq_len` bytes (each window holds `seq_len + 1` tokens, the
    last one overlapping the next window's first, for next-token targets). Learner `i` of `M`
    owns windows `i, i + M, i + 2M, ...`: shards are disjoint and cover all windows but a tail.
  * Each learner shuffles its own shard with `seed + learner_id`, reshuffling every epoch; its
    iterator's position is checkpointed, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig
import zlib

import grain
import numpy as np

from decoupled_diloco.config import ConfigError
from decoupled_diloco.data import sources

_EXCLUDED_DIRS = {"test", "tests", "idlelib", "__pycache__", "site-packages"}
_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}
# Not text to read as bytes: `data.prepare`'s structured inputs, and anything compressed.
_NOT_TEXT = sources.JSONL_SUFFIXES + sources.PARQUET_SUFFIXES
_NOT_TEXT += (".json", ".arrow", ".gz", ".zst", ".bz2", ".xz")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids of a text corpus, split into train and validation."""

    train_BN: np.ndarray
    val_BN: np.ndarray
    num_files: int
    root: str


def default_corpus_root() -> pathlib.Path:
    """The running interpreter's standard library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _corpus_files(root: pathlib.Path) -> list[pathlib.Path]:
    # Excluded folders are pruned, not walked: the walk is most of a (re)starting learner's
    # data loading otherwise (site-packages and tests are large).
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        for name in names:
            path = pathlib.Path(folder, name)
            if path.suffix in _TEXT_SUFFIXES and path.is_file():
                files.append(path)
    return sorted(files)


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the document or file named `key` is held out: a hash of the key, not its order."""
    return zlib.crc32(key.encode()) % 10_000 < val_fraction * 10_000


_PREPARE_FIRST = (
    "holds documents in a structure (JSONL, Parquet, compressed), not text to train on as "
    "bytes: tokenize it once with `python -m decoupled_diloco.data.prepare --input={path} "
    "--output=DIR` and set data.path=DIR (docs/data.md)"
)


def _held_out(keys: list[str], val_fraction: float) -> set[str]:
    """The keys held out by `is_validation`; never none nor all of two or more keys."""
    held_out = {k for k in keys if is_validation(k, val_fraction)}
    if len(keys) >= 2 and not held_out:
        held_out = {min(keys, key=lambda k: (zlib.crc32(k.encode()), k))}
    elif len(keys) >= 2 and len(held_out) == len(keys):
        held_out.discard(max(keys, key=lambda k: (zlib.crc32(k.encode()), k)))
    return held_out


def load_corpus(path: str = "", val_fraction: float = 0.05) -> Corpus:
    """Reads a corpus as bytes (token ids 0..255) and splits it into train and validation.

    Args:
      path: a text file, or a folder searched for .py/.txt/.md/.rst files; empty means the
        Python standard library.
      val_fraction: share of files (or, for one file, of bytes) held out for validation.

    Raises:
      FileNotFoundError: `path` does not exist.
      ConfigError: the corpus holds no usable text, or is a file to prepare first.
    """
    root = pathlib.Path(path) if path else default_corpus_root()
    if not root.exists():
        raise FileNotFoundError(f"config.data.path: {root} does not exist")
    if root.is_file():
        if root.name.lower().endswith(_NOT_TEXT):
            raise ConfigError(f"config.data.path: {root} {_PREPARE_FIRST.format(path=root)}")
        data = np.frombuffer(root.read_bytes(), dtype=np.uint8)
        split = int(len(data) * (1.0 - val_fraction))
        train, val, num_files = data[:split], data[split:], 1
    else:
        files = _corpus_files(root)
        if len(files) < 2:
            structured = sorted(
                {p.suffix for p in root.rglob("*") if p.name.lower().endswith(_NOT_TEXT)}
            )
            hint = (
                f"; it holds {', '.join(structured)} files, which "
                + _PREPARE_FIRST.format(path=root)
                if structured
                else ""
            )
            raise ConfigError(
                f"config.data.path: {root} has {len(files)} text files (counted: "
                f"{', '.join(sorted(_TEXT_SUFFIXES))}, outside {', '.join(sorted(_EXCLUDED_DIRS))}"
                f" folders); need two or more, or name one file{hint}"
            )
        relatives = [f.relative_to(root).as_posix() for f in files]
        held_out = _held_out(relatives, val_fraction)
        train_parts, val_parts = [], []
        for file, relative in zip(files, relatives, strict=True):
            chunk = file.read_bytes() + b"\n\n"
            (val_parts if relative in held_out else train_parts).append(chunk)
        train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
        val = np.frombuffer(b"".join(val_parts), dtype=np.uint8)
        num_files = len(files)
    return Corpus(train_BN=train, val_BN=val, num_files=num_files, root=str(root))


class TokenWindows:
    """Random-access source of `seq_len + 1`-token windows cut every `seq_len` tokens."""

    def __init__(self, tokens_N: np.ndarray, seq_len: int):
        self._tokens_N = tokens_N
        self._seq_len = seq_len
        self._len = max((len(tokens_N) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(index) * self._seq_len
        return self._tokens_N[start : start + self._seq_len + 1].astype(np.int32)

    def __repr__(self) -> str:
        # grain compares sources by repr when restoring an iterator: keep it stable and specific.
        digest = zlib.crc32(self._tokens_N.tobytes())
        return (
            f"TokenWindows(tokens={len(self._tokens_N)}, crc32={digest}, seq_len={self._seq_len})"
        )


def learner_dataset(
    tokens_N: np.ndarray,
    seq_len: int,
    batch_size: int,
    learner_id: int,
    num_learners: int,
    seed: int,
) -> grain.MapDataset:
    """Learner `learner_id`'s infinite, shuffled stream of (batch_size, seq_len + 1) batches."""
    windows = grain.MapDataset.source(TokenWindows(tokens_N, seq_len))
    shard = windows[learner_id::num_learners]
    if len(shard) < batch_size:
        raise ValueError(
            f"config.data.batch_size: learner {learner_id} has {len(shard)} windows of "
            f"{seq_len} tokens, fewer than one batch of {batch_size}; "
            "use more text or fewer learners"
        )
    return shard.shuffle(seed=seed + learner_id).repeat().batch(batch_size, drop_remainder=True)


def train_iterator(
    tokens_N: np.ndarray,
    seq_len: int,
    batch_size: int,
    learner_id: int,
    num_learners: int,
    seed: int,
) -> grain.DatasetIterator:
    """A checkpointable iterator over `learner_dataset` (`get_state` / `set_state`)."""
    dataset = learner_dataset(tokens_N, seq_len, batch_size, learner_id, num_learners, seed)
    return iter(dataset.to_iter_dataset())


def validation_batches(
    tokens_N: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> list[np.ndarray]:
    """The first `num_batches` validation batches, in order: the same for every mode and learner.

    Raises:
      ValueError: the validation split is too small.
    """
    windows = TokenWindows(tokens_N, seq_len)
    needed = num_batches * batch_size
    if len(windows) < needed:
        raise ValueError(
            f"config.eval.batches: validation split has {len(windows)} windows, "
            f"{needed} needed ({num_batches} batches of {batch_size})"
        )
    # Spread the windows over the whole split so evaluation is not one file's first bytes.
    stride = len(windows) // needed
    ids = np.arange(needed) * stride
    stacked = np.stack([windows[i] for i in ids])
    return list(stacked.reshape(num_batches, batch_size, seq_len + 1))
