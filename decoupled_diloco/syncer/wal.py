"""The syncer's write-ahead log: every change a restart must not lose, as one appended record.

Between two Orbax snapshots (`syncer.durability`), each change to the syncer's state is appended
to `wal/SEQ.log` (SEQ: the snapshot it follows) under the state lock: a push as received (its
counters and idempotency key; its outer gradient stays in the push store, `syncer.payloads`,
as the bytes that arrived), that a merge happened (replay merges the same pushes again, so no
values are written), a refused merge, a registration. A restart restores a snapshot and
re-applies the records after it, through the same code that made the changes.

A record: magic, header length, payload length, CRC-32 of both, a JSON header (what changed and
the dtype and shape of each array) and the arrays' raw bytes. A record cut short by a crash
fails its length or CRC check; reading stops there (it was never acknowledged: acknowledgements
wait for `sync`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.syncer import elastic
from decoupled_diloco.syncer.payloads import Payload
from decoupled_diloco.syncer.records import LearnerInfo, Push, PushResult
from decoupled_diloco.syncer.state import SyncerState

_MAGIC = b"DDW1"
_HEAD = struct.Struct("<4sIQI")  # magic, header bytes, payload bytes, CRC-32


class WriteAheadLog:
    """An append-only record file (see the module doc).

    Args:
      path: the log file (appended to if it exists).
    """

    def __init__(self, path: pathlib.Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.records = 0

    def record(self, state: SyncerState, kind: str, *args: Any) -> None:
        """Appends the result of change `kind` (`SyncerState.record_change`), under its lock."""
        header, arrays = _describe(state, kind, *args)
        self.append(header, arrays)

    def append(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Appends one record (written to the OS at once; `sync` makes it durable)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        header = {**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
        meta = json.dumps(header).encode()
        payload = b"".join(a.tobytes() for a in arrays)
        crc = zlib.crc32(payload, zlib.crc32(meta))
        data = memoryview(_HEAD.pack(_MAGIC, len(meta), len(payload), crc) + meta + payload)
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # (a full disk): no torn record may hide the ones appended after it
            os.ftruncate(self._fd, start)
            raise
        self.records += 1

    def sync(self) -> None:
        """Blocks until every appended record is on disk."""
        os.fdatasync(self._fd)

    def close(self) -> None:
        """Syncs and closes the file."""
        self.sync()
        os.close(self._fd)


def read(path: pathlib.Path) -> Iterator[tuple[dict[str, Any], list[np.ndarray]]]:
    """The records of one log file, in order, up to the first incomplete or corrupt one."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if len(data) - at < _HEAD.size:
            break
        magic, meta_n, payload_n, crc = _HEAD.unpack_from(data, at)
        start, end = at + _HEAD.size, at + _HEAD.size + meta_n + payload_n
        if magic != _MAGIC or end > len(data):
            break
        meta, payload = data[start : start + meta_n], data[start + meta_n : end]
        if zlib.crc32(payload, zlib.crc32(meta)) != crc:
            break
        header = json.loads(meta)
        arrays, offset = [], 0
        for dtype, shape in header.pop("arrays"):
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            arrays.append(
                np.frombuffer(payload, dtype, offset=offset, count=n // np.dtype(dtype).itemsize)
                .reshape(shape)
                .copy()
            )
            offset += n
        yield header, arrays
        at = end
    if at < len(data):
        logging.warning(
            "%s: ignoring %d bytes after record-%d (cut short by a crash, never acknowledged)",
            path,
            len(data) - at,
            at,
        )


def _describe(state: SyncerState, kind: str, *args: Any) -> tuple[dict[str, Any], list]:
    """The record of one change, read from the state right after it."""
    if kind == "register":
        (learner,) = args
        return {
            "kind": kind,
            "seq": state.seq,
            "learner": learner,
            "mesh": state.learners[learner].mesh,
            "incarnation": state.learners[learner].incarnation,
        }, []
    if kind == "push":
        key, push = args
        learner, p, rnd = key
        f, result = state.fragments[p], state.seen[key]
        header = {
            "kind": kind,
            "seq": state.seq,
            "key": list(key),
            "result": list(dataclasses.astuple(result)),
            "late": f.late,
            "pushes": state.learners[learner].pushes,
            "push": None,
        }
        arrays: list[np.ndarray] = []
        if result.accepted and not result.duplicate:  # the push as received: replayed as is
            entry = {k: v for k, v in dataclasses.asdict(push).items() if k != "delta"}
            payload = push.delta
            if isinstance(payload, Payload) and payload.path:
                entry["payload"] = payload.describe()  # its bytes are in the push store
            else:  # an in-process caller's arrays
                entry["payload"] = None
                arrays = list(payload.arrays if isinstance(payload, Payload) else payload)
            header["push"] = entry
        return header, arrays
    if kind == "refuse":  # a refused merge: its pushes are gone; no values are written
        (p,) = args
        f = state.fragments[p]
        dropped = {str(i): x.dropped_pushes for i, x in state.learners.items()}
        return {
            "kind": kind,
            "seq": state.seq,
            "fragment": p,
            "refused": f.refused_merges,
            "dropped": dropped,
        }, []
    if kind == "merge":  # replayed by merging again: the same pushes give the same values
        p, live = args
        f = state.fragments[p]
        return {
            "kind": kind,
            "seq": state.seq,
            "fragment": p,
            "version": f.version,
            "live": live,
        }, []
    if kind == "lease":  # a lease handed to a learner
        learner, lease = args
        return {"kind": kind, "seq": state.seq, "learner": learner, "lease": lease}, []
    raise ValueError(f"unknown syncer change {kind!r}")


def apply(state: SyncerState, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """Re-applies one record to the state (call under its lock)."""
    now, kind = state.clock(), header["kind"]
    if kind == "register":
        learner = header["learner"]
        info = state.learners.setdefault(learner, LearnerInfo())
        info.mesh, info.state, info.last_seen = header["mesh"], "training", now
        info.incarnation = header.get("incarnation", info.incarnation + 1)
        state.seen = {k: v for k, v in state.seen.items() if k[0] != learner}
        if state.ledger is not None:
            state.ledger.release(learner)
        elastic.log_membership(state, "joined" if info.incarnation == 0 else "restarted", learner)
    elif kind == "lease":
        state.ledger.take(header["lease"], header["learner"])
    elif kind == "push":
        learner, p, rnd = header["key"]
        f = state.fragments[p]
        result = PushResult(*header["result"])
        if header["push"] is not None:
            entry = dict(header["push"])
            described = entry.pop("payload")
            delta = (
                arrays if described is None else Payload.described(described, f.specs, state.store)
            )
            state.add_push(f, Push(**entry, delta=delta))
        state.seen[(learner, p, rnd)] = result
        f.late = header["late"]
        info = state.learners.setdefault(learner, LearnerInfo())
        info.pushes, info.last_seen = header["pushes"], now
    elif kind == "refuse":
        p = header["fragment"]
        f = state.fragments[p]
        state.refuse_merge(p, [f.pending[i] for i in sorted(f.pending)], "replayed")
        f.refused_merges = header["refused"]
        for i, dropped in header["dropped"].items():
            state.learners.setdefault(int(i), LearnerInfo()).dropped_pushes = dropped
    elif kind == "merge":
        p = header["fragment"]
        f = state.fragments[p]
        hook, state.merge_hook = state.merge_hook, None
        try:
            state.merge_fragment(p, live=header.get("live"))
        finally:
            state.merge_hook = hook
        if f.version != header["version"]:
            raise ValueError(
                f"write-ahead log replay: fragment {p} merged to version {f.version}, the log "
                f"says {header['version']} (a log of another run or configuration?)"
            )
        f.published, f.published_values, f.closed_t = f.version, f.values, None
    else:
        raise ValueError(f"unknown syncer change {kind!r}")
    state.seq = header["seq"]
