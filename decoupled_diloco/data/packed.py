"""Training on a prepared corpus: memory-mapped shards read by window index, documents packed.

A split's shards are one token stream (in manifest order). Window `i` holds tokens
`[i·T, i·T + T + 1)` of the stream (T = `seq_len`), across a shard boundary where it falls on
one, so windows are addressed by index whatever the corpus size: learner `i` of `M` (or lease
`k` of `S`) owns windows `i, i + M, ...`, shuffled by grain's index permutation, exactly as on
the byte corpus (`data/text.py`). Only the pages of the windows read are touched, so memory does
not grow with the corpus.

Each window comes as a dict of (T + 1,) int32 arrays: `tokens`, `segment_ids` (0 for the
window's first document, +1 at each document that starts inside it) and `positions` (the
token's place in its document's part of the window). The built-in models attend within a
segment only (`model.document_mask`); a user's task receives the same dict.

A training iterator's checkpointed state carries the tokenizer's digest and the corpus's, and
a state saved on other data is refused when it is restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

import grain
import numpy as np

from decoupled_diloco.data import shards as shards_lib

VOCAB_MULTIPLE = 128  # the model's vocabulary: the tokenizer's, padded to a multiple of this


def padded_vocab(vocab_size: int) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of `VOCAB_MULTIPLE`."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def identity(manifest: dict[str, Any]) -> dict[str, str]:
    """The tokenizer's digest and the corpus's (a digest of every shard's SHA-256)."""
    checksums = json.dumps([s["sha256"] for s in manifest["shards"]]).encode()
    return {
        "tokenizer": manifest["tokenizer"]["digest"],
        "corpus": hashlib.sha256(checksums).hexdigest()[:16],
    }


class TokenStream:
    """A split's shards as one stream of tokens with its document starts."""

    def __init__(self, shards: list[shards_lib.Shard]):
        # Tokens are read with pread, not through the map: a fault on a mapped page maps the
        # whole (large) page-cache folio around it, so a learner's resident memory grew with
        # the corpus (measured: 1.8 MB per 2 KB window read). The index stays mapped.
        self._files = [open(s.path, "rb") for s in shards]  # (open while the stream is used)
        self._data_at = [int(s.tokens_N.offset) for s in shards]
        self._dtype = shards[0].tokens_N.dtype if shards else np.dtype(np.uint16)
        self._sizes = [len(s.tokens_N) for s in shards]
        # Plain ndarray views of the maps: np.memmap's own indexing costs more than the read.
        self.offsets = [s.offsets_D1.view(np.ndarray) for s in shards]
        self.shards = shards
        sizes = [len(s.tokens_N) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_documents = sum(len(s.offsets_D1) - 1 for s in shards)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, is_document_start) of `[start, start + length)` as int32 / bool arrays."""
        tokens = np.empty(length, np.int32)
        starts = np.zeros(length, bool)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            offsets, itemsize = self.offsets[shard], self._dtype.itemsize
            local = start + done - int(self.starts[shard])
            take = min(length - done, self._sizes[shard] - local)
            raw = os.pread(
                self._files[shard].fileno(),
                take * itemsize,
                self._data_at[shard] + local * itemsize,
            )
            tokens[done : done + take] = np.frombuffer(raw, self._dtype)
            # (uint64 keys: a Python int would make numpy convert the whole index to compare)
            first, last = offsets.searchsorted(np.array([local, local + take], np.uint64))
            starts[done + offsets[first:last].astype(np.int64) - local] = True
            done += take
            shard += 1
        return tokens, starts


def pack(tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """The window dict: tokens, segment ids and positions within each segment.

    Segments are counted from the window's first document (0), whatever it is.
    """
    starts = starts.copy()
    starts[0] = False  # the window's first token begins segment 0 whatever it is
    segment_ids = np.cumsum(starts, dtype=np.int32)
    index = np.arange(len(tokens), dtype=np.int32)
    segment_start = np.maximum.accumulate(np.where(starts, index, 0))
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": index - segment_start}


class PackedWindows:
    """Random-access source (grain) of `seq_len + 1`-token packed windows cut every `seq_len`."""

    def __init__(self, stream: TokenStream, seq_len: int, fingerprint: str):
        self._stream, self._seq_len, self._fingerprint = stream, seq_len, fingerprint
        self._len = max((len(stream) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens, starts = self._stream.window(int(index) * self._seq_len, self._seq_len + 1)
        return pack(tokens, starts)

    def __repr__(self) -> str:
        # grain compares sources by repr when restoring an iterator: stable and specific.
        return f"PackedWindows({self._fingerprint}, seq_len={self._seq_len})"


class DataMismatchError(ValueError):
    """A checkpointed data position that belongs to other data than this run's."""


class CheckedIterator:
    """A grain iterator whose state names the data it walks, checked when it is restored."""

    def __init__(self, iterator: grain.DatasetIterator, identity: dict[str, str]):
        self._iterator, self._identity = iterator, identity

    def __iter__(self) -> CheckedIterator:
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        """The grain state, with the tokenizer's and the corpus's digests."""
        return {**self._identity, "grain": self._iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position saved on the same data.

        Raises:
          DataMismatchError: the state was saved on data of another tokenizer or corpus.
        """
        saved = {k: state.get(k) for k in self._identity} if isinstance(state, dict) else {}
        if saved.get("tokenizer") != self._identity["tokenizer"]:
            raise DataMismatchError(
                f"the checkpoint was trained on data tokenized by {saved.get('tokenizer')!r}; "
                f"config.data.path holds data tokenized by {self._identity['tokenizer']!r}: "
                "resume on the data it was trained on, or start in a fresh workdir"
            )
        if saved != self._identity:
            raise DataMismatchError(
                f"the checkpoint's data position is in corpus {saved.get('corpus')!r}; "
                f"config.data.path holds corpus {self._identity['corpus']!r} (prepared again?): "
                "resume on the data it was trained on, or start in a fresh workdir"
            )
        self._iterator.set_state(state["grain"])


class PreparedDataset:
    """A prepared directory as a `Dataset` (`data/dataset.py`): shards per learner or lease.

    Args:
      directory: written by `data.prepare`.
      seq_len: tokens per window.
      verify: check every shard's SHA-256 on opening (sizes are always checked).

    Raises:
      shards.PreparedDataError: the directory is unfinished, of another format version, or
        a shard is missing, truncated or corrupted.
    """

    def __init__(self, directory: str | pathlib.Path, seq_len: int, verify: bool = True):
        self.directory = pathlib.Path(directory)
        self.manifest = shards_lib.read_manifest(self.directory)
        self.seq_len = seq_len
        self.tokenizer_info = self.manifest["tokenizer"]
        self.streams = {
            split: TokenStream(shards_lib.open_shards(self.directory, self.manifest, split, verify))
            for split in shards_lib.SPLITS
        }
        self.identity = identity(self.manifest)
        fingerprint = f"{self.identity['tokenizer']}/{self.identity['corpus']}"
        self.windows = {s: PackedWindows(v, seq_len, fingerprint) for s, v in self.streams.items()}

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary."""
        return int(self.tokenizer_info["vocab_size"])

    def tokenizer(self) -> Any:
        """The tokenizer the corpus was prepared with (`data.tokenizer`)."""
        from decoupled_diloco.data import tokenizer as tokenizer_lib

        info = self.tokenizer_info
        return tokenizer_lib.load_saved(self.directory, info["kind"], info["file"], info["eos_id"])

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int):
        """Shard `learner_id` of `num_learners`, shuffled and batched (a `CheckedIterator`).

        Its windows are shuffled by `seed + learner_id` and reshuffled every epoch.

        Raises:
          ValueError: the shard holds fewer windows than one batch.
        """
        shard = grain.MapDataset.source(self.windows["train"])[learner_id::num_learners]
        if len(shard) < batch_size:
            raise ValueError(
                f"config.data.batch_size: learner {learner_id} of {num_learners} has "
                f"{len(shard)} windows of {self.seq_len} tokens in {self.directory}, fewer "
                f"than one batch of {batch_size}; prepare more text or use fewer learners"
            )
        batches = (
            shard.shuffle(seed=seed + learner_id).repeat().batch(batch_size, drop_remainder=True)
        )
        # One reader thread: the window reads hold the GIL, so more threads only contend
        # (1 thread: 6.3M tokens/s at sequence 1024, batch 32; grain's default 16: 2.3M).
        options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        return CheckedIterator(iter(batches.to_iter_dataset(options)), self.identity)

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
        """The first `num_batches` batches of windows spread evenly over the validation split.

        Raises:
          ValueError: the validation split is too small.
        """
        windows, needed = self.windows["val"], num_batches * batch_size
        if len(windows) < needed:
            raise ValueError(
                f"config.eval.batches: the validation split of {self.directory} has "
                f"{len(windows)} windows of {self.seq_len} tokens, {needed} needed "
                f"({num_batches} batches of {batch_size}); prepare with a larger --val_fraction "
                "or lower eval.batches"
            )
        stride = len(windows) // needed
        rows = [windows[i * stride] for i in range(needed)]
        return [
            {
                k: np.stack([r[k] for r in rows[b * batch_size : (b + 1) * batch_size]])
                for k in rows[0]
            }
            for b in range(num_batches)
        ]

    def validation_bytes(self, batch_size: int, num_batches: int) -> int:
        """The UTF-8 bytes of text the validation batches' targets stand for (bits per byte).

        Each window's targets (all but its first token) decoded with the corpus's tokenizer;
        end-of-document tokens stand for no text. A window that starts or ends inside a
        multi-byte character counts its replacement character instead (a few bytes in
        thousands).
        """
        tokenizer = self.tokenizer()
        return sum(
            len(tokenizer.decode(row[1:]).encode("utf-8"))
            for batch in self.validation_batches(batch_size, num_batches)
            for row in batch["tokens"]
        )

    def describe(self) -> tuple[str, dict[str, Any]]:
        """The directory, tokenizer and split sizes (for `summary.json`)."""
        totals = self.manifest["totals"]
        return "corpus", {
            "root": str(self.directory),
            "format": f"{shards_lib.FORMAT}/{shards_lib.VERSION}",
            "tokenizer": self.tokenizer_info["kind"],
            "tokenizer_digest": self.identity["tokenizer"],
            "corpus_digest": self.identity["corpus"],
            "vocab_size": self.vocab_size,
            "documents": totals["train"]["documents"] + totals["val"]["documents"],
            "train_tokens": totals["train"]["tokens"],
            "val_tokens": totals["val"]["tokens"],
            "train_bytes": totals["train"]["bytes"],
            "val_bytes": totals["val"]["bytes"],
        }
