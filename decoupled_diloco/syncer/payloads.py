"""Pushes as received: their encoded bytes, kept on disk, not in memory, until their round closes.

The syncer folds each push into its fragment's open round as it arrives (`core.accumulate`)
and keeps nothing per learner in memory. It may need a push's outer gradient again: when the
same learner's next push supersedes it (its fold is taken out), when the round closes and a
push's weight share is capped (its fold is corrected), and when a restarted syncer rebuilds its
open rounds. For that, the handler writes every admitted push's payload, exactly as received
(compressed or not), to a file of the `PushStore` before the state sees it; the state, its
write-ahead log and its snapshots refer to it by name.

A file is deleted once nothing can need it: at once when its push is refused, and when its
round has closed (or the push was superseded), once that change is in the oldest snapshot kept
(a restart from an older one replays the push). Without a checkpoint directory the files live
in a temporary directory, unsynced, and go as soon as their round closes.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from decoupled_diloco.comm import wire
from decoupled_diloco.core import compression
from decoupled_diloco.core.compression import Codec
from decoupled_diloco.core.fragments import TensorSpec

_RAW = Codec("none")


class Payload:
    """One push's outer gradient: the encoding of each tensor and where its bytes are.

    Args:
      specs: the fragment's tensor specs.
      codecs: each tensor's encoding (as its header declared and `wire.check_headers` checked).
      data: the bytes in memory (the handler's buffer, or a test's); None once stored.
      path: the stored copy (a `PushStore.create` file), read back tensor by tensor.
      arrays: an outer gradient given as arrays (tests and in-process callers), kept as is.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        codecs: Sequence[Codec] | None = None,
        data: memoryview | bytes | None = None,
        path: str = "",
        arrays: Sequence[np.ndarray] | None = None,
    ):
        self.specs = list(specs)
        self.codecs = list(codecs) if codecs is not None else [_RAW] * len(self.specs)
        self.data, self.path = data, path
        self.arrays = None if arrays is None else [np.asarray(a) for a in arrays]
        self.sizes = [
            compression.nbytes(c, math.prod(s.shape), s.dtype)
            for c, s in zip(self.codecs, self.specs, strict=True)
        ]

    @classmethod
    def of_arrays(cls, specs: Sequence[TensorSpec], arrays: Sequence[np.ndarray]) -> Payload:
        """An outer gradient given as arrays (one per spec)."""
        return cls(specs, arrays=arrays)

    def stored(self) -> Payload:
        """The same payload without its in-memory bytes (read from `path` from now on)."""
        if not self.path:
            return self
        return Payload(self.specs, self.codecs, path=self.path)

    def tensors(self, check: bool = False) -> Iterator[np.ndarray]:
        """Its tensors, decoded one at a time (float32 arrays of the specs' shapes).

        Args:
          check: refuse non-finite values (`wire.decode_tensor` raises `PayloadError`); the
            content of compressed tensors is always checked.
        """
        if self.arrays is not None:
            yield from self.arrays
            return
        if self.data is not None:
            data, offset = memoryview(self.data), 0
            for codec, spec, size in zip(self.codecs, self.specs, self.sizes, strict=True):
                yield wire.decode_tensor(data[offset : offset + size], codec, spec, check)
                offset += size
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            offset = 0
            for codec, spec, size in zip(self.codecs, self.specs, self.sizes, strict=True):
                raw = os.pread(fd, size, offset)
                if len(raw) != size:
                    raise OSError(f"{self.path}: cut short at byte {offset + len(raw)}")
                yield wire.decode_tensor(raw, codec, spec, check)
                offset += size
        finally:
            os.close(fd)

    def describe(self) -> dict:
        """What the write-ahead log and snapshots record of it (JSON)."""
        return {
            "path": os.path.basename(self.path),
            "codecs": [[c.scheme, c.block_size, c.values, c.k] for c in self.codecs],
        }

    @classmethod
    def described(
        cls, entry: dict, specs: Sequence[TensorSpec], store: PushStore | None
    ) -> Payload:
        """The payload `describe` recorded, read from `store`."""
        if store is None:
            raise ValueError("a recorded push needs the syncer's push store to be read back")
        codecs = [Codec(s, b, v, k) for s, b, v, k in entry["codecs"]]
        return cls(specs, codecs, path=str(store.directory / entry["path"]))


class PushStore:
    """The files of pushes whose rounds are open (see the module doc).

    Args:
      directory: where the files go (created); None: a temporary directory, removed by
        `close`, whose files are never synced.
      durable: sync each file (and the directory) before `put` returns.
    """

    def __init__(self, directory: str | pathlib.Path | None = None, durable: bool = False):
        self._temporary = directory is None
        self.directory = pathlib.Path(
            tempfile.mkdtemp(prefix="dd_pushes_") if directory is None else directory
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self._released: list[tuple[int, str]] = []  # (change seq, path) deleted later
        self._lock = threading.Lock()

    def create(self) -> PushFile:
        """A new file for one payload, written as its chunks arrive (`PushFile`)."""
        return PushFile(self)

    def sync_directory(self) -> None:
        """Makes the directory's new entries durable."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def drop(self, path: str) -> None:
        """Deletes a file no change refers to (its push was refused)."""
        if path:
            pathlib.Path(path).unlink(missing_ok=True)

    def release(self, path: str, seq: int) -> None:
        """Change `seq` no longer needs the file: deleted now, or (durable) once it is old."""
        if not path:
            return
        if not self.durable:
            self.drop(path)
            return
        with self._lock:
            self._released.append((seq, path))

    def purge(self, oldest_kept: int) -> None:
        """Deletes the files released by changes the oldest kept snapshot already holds."""
        with self._lock:
            due = [p for s, p in self._released if s <= oldest_kept]
            self._released = [(s, p) for s, p in self._released if s > oldest_kept]
        for path in due:
            self.drop(path)

    def adopt(self, referenced: set[str], seq: int) -> None:
        """After a restore: files nothing refers to now are released at change `seq`."""
        for path in self.directory.glob("*.push"):
            if path.name not in referenced:
                self.release(str(path), seq)

    def close(self) -> None:
        """Removes a temporary store's directory."""
        if self._temporary:
            shutil.rmtree(self.directory, ignore_errors=True)


class PushFile:
    """One payload being written to its `PushStore` (chunk by chunk, as it arrives)."""

    def __init__(self, store: PushStore):
        self.store = store
        self.path = str(store.directory / f"{uuid.uuid4().hex}.push")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write(self, data: memoryview | bytes) -> None:
        """Appends bytes."""
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self._fd, view) :]

    def finish(self) -> str:
        """Closes the file (synced, with its directory entry, in a durable store); its path."""
        try:
            if self.store.durable:
                os.fdatasync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        if self.store.durable:
            self.store.sync_directory()
        return self.path

    def abort(self) -> None:
        """Closes and deletes the file (the push was refused)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.store.drop(self.path)
