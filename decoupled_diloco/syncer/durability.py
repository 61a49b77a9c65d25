"""Durable syncer state: a write-ahead log plus Orbax snapshots; nothing acknowledged early.

The guarantee: a syncer started with a checkpoint directory publishes a merged version (makes
it pullable and reports it in register, heartbeat and status replies) and acknowledges a push
or a registration only after the change is on disk. Every change is appended to a write-ahead
log (`syncer.wal`) under the state lock, as its result; one committer thread syncs the log
(`fdatasync`, one sync for all changes since the last) and then publishes, so acknowledgement
costs a disk sync, not a checkpoint. Every `snapshot_s` seconds (or more, see `Committer`) a
second thread writes an Orbax snapshot of the whole state (global fragments, outer optimizer
state, version history, pending pushes, per-learner counters, idempotency keys) and starts a
new log; it holds the lock only to take the snapshot's arrays and swap the log, so the syncs
and acknowledgements go on while it writes.

A restart restores the newest readable snapshot and re-applies the logs after it, so it never
loses anything a learner was told: versions never go backwards, an accepted push is merged or
still pending, and a retried push is still recognized by its idempotency key. A change lost in
a crash (its record cut short or never synced) was never acknowledged: the learner retries the
push or never saw the version. An unreadable snapshot is skipped with a warning; the previous
one and the logs since it (logs are kept for every kept snapshot) rebuild the same state.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco import runtime
from decoupled_diloco.checkpointing import IslandCheckpointer
from decoupled_diloco.core import host
from decoupled_diloco.syncer import wal
from decoupled_diloco.syncer.payloads import Payload
from decoupled_diloco.syncer.records import LearnerInfo, Pending, PushResult
from decoupled_diloco.syncer.state import SyncerState

FORMAT = 2  # 2: outer gradients of open rounds in the push store, optimizer state flat


def snapshot(
    state: SyncerState,
) -> tuple[dict[str, Any], dict[str, Any], dict[int, tuple[int, list[np.ndarray]]]]:
    """A consistent view of the state; call under `state.lock`.

    The arrays are the state's own, not copies: a merge installs new values (`FragmentState`)
    and never writes into ones it has installed, and steps the optimizer state in place only
    where no numpy view of it is held (`FlatStep`), so they stay as they are while Orbax
    writes them (outside the lock).

    Returns:
      (tree of arrays for Orbax, JSON metadata, {fragment: (version, values)} to publish).
    """
    tree, fragments, published = {}, {}, {}
    for p in sorted(state.owned):
        f = state.fragments[p]
        pending, in_memory = [], {}
        for x in f.pending.values():  # in fold order: a restore folds them again in it
            pending.append(x.describe())
            for j, (_, payload) in enumerate(x.parts):
                if not payload.path:  # an in-process caller's arrays: saved as arrays
                    # (copied: the snapshot is written as it is, and the caller owns them)
                    in_memory[f"l{x.learner_id}p{j}"] = [np.array(a) for a in payload.arrays]
        tree[f"f{p}"] = {
            "values": list(f.values),
            # (numpy views: while one is held, XLA writes the next merge's state anew
            # instead of stepping these arrays in place, `core.accumulate.FlatStep`)
            "opt": [np.asarray(x) for x in f.opt_state],
            "history": {
                f"v{v}": {f"t{t}": a for t, a in kept.items()} for v, kept in f.history.items()
            },
            "pending": in_memory,
        }
        fragments[str(p)] = {
            "version": f.version,
            "merges": f.merges,
            "late": f.late,
            "duplicates": f.duplicates,
            "refused_merges": f.refused_merges,
            "norm": f.norm(),  # (a merge replayed on restore meets the same bounds)
            "pending": pending,
        }
        published[p] = (f.version, f.values)
    learners = {}
    for i, info in state.learners.items():
        entry = dataclasses.asdict(info)
        for clocked in ("last_seen", "last_chunk", "pace_from", "seen_step_s"):  # (this clock)
            entry.pop(clocked)
        learners[str(i)] = entry
    meta = {
        "format": FORMAT,
        "seq": state.seq,
        "owned": sorted(state.owned),
        "num_fragments": len(state.fragments),
        "fragments": fragments,
        "learners": learners,
        "seen": [[*key, *dataclasses.astuple(result)] for key, result in state.seen.items()],
        "ema": [state.ema_step.value, state.ema_quorum.value, state.ema_sync.value],
        "merge_sizes": list(state.merge_sizes),
        "merge_log": state.merge_log[-200:],
        "ledger": None if state.ledger is None else state.ledger.to_json(),
        "membership": state.membership[-200:],
        "wall_time": time.time(),
    }
    return tree, meta, published


def _arrays(values: Any, specs: Any, where: str) -> list[np.ndarray]:
    arrays = [np.asarray(x) for x in values]
    got = [(tuple(a.shape), str(a.dtype)) for a in arrays]
    want = [(tuple(s.shape), s.dtype) for s in specs]
    if got != want:
        raise ValueError(
            f"syncer checkpoint {where}: tensors {got} do not match the model's {want} "
            "(was config.model or decoupled.fragments changed since it was written?)"
        )
    return arrays


def load(state: SyncerState, tree: dict[str, Any], meta: dict[str, Any]) -> None:
    """Replaces `state`'s contents with a restored snapshot.

    Raises:
      ValueError: the checkpoint belongs to another shard layout or model.
    """
    if meta.get("format") != FORMAT:
        raise ValueError(f"syncer checkpoint format {meta.get('format')} != {FORMAT}")
    if meta["owned"] != sorted(state.owned) or meta["num_fragments"] != len(state.fragments):
        raise ValueError(
            f"syncer checkpoint holds fragments {meta['owned']} of {meta['num_fragments']}, this "
            f"shard owns {sorted(state.owned)} of {len(state.fragments)} (decoupled.fragments or "
            "decoupled.syncer.shards changed, or another shard's checkpoint directory)"
        )
    now = state.clock()
    with state.lock:
        for p in sorted(state.owned):
            f, saved, info = state.fragments[p], tree[f"f{p}"], meta["fragments"][str(p)]
            values = _arrays(saved["values"], f.specs, f"fragment {p}")
            flat = host.aligned_zeros(sum(v.size for v in values))
            np.concatenate([v.reshape(-1) for v in values], out=flat)
            f.set_flat(flat, info.get("norm"))
            f.opt_state = [
                host.aligned_copy(x) if np.ndim(x) else np.asarray(x) for x in saved["opt"]
            ]
            template = state.math[p].step.shapes()
            if [x.shape for x in f.opt_state] != template:
                raise ValueError(
                    f"syncer checkpoint fragment {p}: outer optimizer state of shapes "
                    f"{[x.shape for x in f.opt_state]}, the configured optimizer has "
                    f"{template} (was config.outer changed since?)"
                )
            f.history = {
                int(k[1:]): {int(t[1:]): np.asarray(a) for t, a in kept.items()}
                for k, kept in saved["history"].items()
            }
            f.version = f.published = info["version"]
            f.published_values = f.values
            f.merges, f.late, f.duplicates = info["merges"], info["late"], info["duplicates"]
            f.refused_merges = info.get("refused_merges", 0)
            f.pending, f.round = {}, None
            for entry in info["pending"]:
                parts = []
                for j, (base, described) in enumerate(entry["parts"]):
                    if described["path"]:
                        payload = Payload.described(described, f.specs, state.store)
                    else:
                        arrays = saved["pending"][f"l{entry['learner_id']}p{j}"]
                        payload = Payload.of_arrays(f.specs, _arrays(arrays, f.specs, "pending"))
                    parts.append((base, payload))
                pending = Pending(**{**entry, "parts": parts})
                state.math[p].fold(f, pending)
                f.pending[pending.learner_id] = pending
            # Open rounds start their timing again; the closer thread re-checks the quorum.
            f.first_push_t = now if f.pending else None
            f.quorum_t = f.closed_t = None
        # Learners count as just seen: each gets `learner_timeout_s` to show up again.
        state.learners = {
            int(i): LearnerInfo(**entry, last_seen=now) for i, entry in meta["learners"].items()
        }
        state.seen = {(i, p, r): PushResult(*rest) for i, p, r, *rest in meta["seen"]}
        for ema, value in zip(
            (state.ema_step, state.ema_quorum, state.ema_sync), meta["ema"], strict=True
        ):
            ema.value = value
        sizes = list(meta["merge_sizes"])
        state.merge_sizes = sizes + [0] * (len(state.merge_sizes) - len(sizes))
        state.membership = list(meta.get("membership", []))
        state.live_ids = set(state.live_learners(now))
        if state.ledger is not None and meta.get("ledger"):
            state.ledger.load(meta["ledger"])
        state.merge_log = list(meta["merge_log"])
        state.seq = state.committed_seq = meta["seq"]


# Snapshots are at least this many times their own duration apart (see `Committer`).
SNAPSHOT_DUTY = 4.0


class Committer:
    """Makes a `SyncerState` durable: a write-ahead log, Orbax snapshots, then publication.

    Args:
      state: the syncer's state; `durable` is switched on.
      directory: this shard's checkpoint directory (created if missing): Orbax snapshots in
        `snapshots/SEQ`, write-ahead logs in `wal/SEQ.log`.
      max_to_keep: newest snapshots kept (with the logs that follow each of them).
      snapshot_s: at least this long between two snapshots; and at least `SNAPSHOT_DUTY`
        times as long as the last one took, so that writing snapshots never takes more than
        1 / (1 + SNAPSHOT_DUTY) of the disk's time (a 1B-parameter state takes ~20 s here).
    """

    def __init__(
        self,
        state: SyncerState,
        directory: str | pathlib.Path,
        max_to_keep: int = 3,
        snapshot_s: float = 10.0,
    ):
        self.state, self.snapshot_s = state, snapshot_s
        self.directory = pathlib.Path(directory).absolute()
        self.wal_dir = self.directory / "wal"
        self.checkpointer = IslandCheckpointer(
            self.directory / "snapshots", max_to_keep, immutable_host_arrays=True
        )
        self.syncs = self.snapshots = self.replayed = 0
        self.sync_s = self.snapshot_time_s = 0.0
        self._last_snapshot = (-1, 0.0)  # (seq, monotonic time)
        self._last_snapshot_s = 0.0  # how long the last one took
        # Logs a snapshot replaced: synced, closed by the committer once it is done with them.
        self._retired: list[wal.WriteAheadLog] = []
        self._stop = threading.Event()
        # Two threads: the committer syncs the log and publishes (every acknowledgement waits
        # for it), the snapshotter writes snapshots (seconds to minutes at large sizes).
        self._thread = threading.Thread(target=self._run, name="syncer-committer", daemon=True)
        self._snapshotter = threading.Thread(
            target=self._snapshots, name="syncer-snapshots", daemon=True
        )
        state.durable = True

    def _logs(self, since: int) -> list[pathlib.Path]:
        logs = (
            [p for p in self.wal_dir.glob("*.log") if p.stem.isdigit()]
            if self.wal_dir.exists()
            else []
        )
        return sorted((p for p in logs if int(p.stem) >= since), key=lambda p: int(p.stem))

    def restore(self) -> int | None:
        """Loads the newest readable snapshot and re-applies the logs after it.

        Returns:
          The state's change count after the restore (None: nothing on disk, a fresh start).
          An unreadable newer snapshot is skipped with a warning (and deleted, so that snapshots
          can go on past it); the logs still hold what it held, so nothing is lost.
        """
        steps = self.checkpointer.all_steps()
        found = self.checkpointer.restore_latest(None)
        step = found[0] if found else 0
        if steps and step != steps[-1]:
            logging.warning(
                "syncer checkpoint %s/%d is unreadable; falling back to snapshot %s and the "
                "write-ahead logs after it",
                self.checkpointer.directory,
                steps[-1],
                step if found else "none (the initial state)",
            )
        self.checkpointer.discard_after(step)
        if found is not None:
            _, tree, meta = found
            load(self.state, tree, meta)
        logs = self._logs(step)
        with self.state.lock:
            for path in logs:
                for header, arrays in wal.read(path):
                    if header["seq"] > self.state.seq:
                        wal.apply(self.state, header, arrays)
                        self.replayed += 1
            self.state.committed_seq = self.state.seq
            if self.state.store is not None:  # files nothing refers to go once they are old
                referenced = {
                    pathlib.Path(payload.path).name
                    for f in self.state.fragments
                    for x in f.pending.values()
                    for _, payload in x.parts
                    if payload.path
                }
                self.state.store.adopt(referenced, self.state.seq)
        if found is None and not logs:
            return None
        return self.state.seq

    @property
    def snapshot_seq(self) -> int:
        """The change count the newest finished snapshot holds (-1: none yet)."""
        return self._last_snapshot[0]

    def start(self) -> Committer:
        """Writes the starting snapshot (unless one holds this state), then starts the thread."""
        if self.state.seq not in self.checkpointer.all_steps():
            self._snapshot()
        else:  # restarted on an unchanged snapshot: keep appending to its log
            self.state.wal = wal.WriteAheadLog(self.wal_dir / f"{self.state.seq}.log")
            self._last_snapshot = (self.state.seq, time.monotonic())
        self._thread.start()
        self._snapshotter.start()
        return self

    def _snapshot(self) -> None:
        """An Orbax snapshot of the state; later changes go to a new log."""
        t0 = time.perf_counter()
        with self.state.lock:
            if self.state.seq == self._last_snapshot[0]:
                return  # nothing new since the last one
            tree, meta, _ = snapshot(self.state)
            seq = self.state.seq
            old, new = self.state.wal, wal.WriteAheadLog(self.wal_dir / f"{seq}.log")
            if old is not None:  # its changes are durable before any goes to the next log
                try:
                    old.sync()
                except BaseException:
                    new.close()  # (an empty log: a restore reads nothing from it)
                    raise
                self._retired.append(old)
            self.state.wal = new
        self.checkpointer.save(seq, tree, meta)
        self.checkpointer.wait()
        self._last_snapshot = (seq, time.monotonic())
        self._last_snapshot_s = time.perf_counter() - t0
        kept = self.checkpointer.all_steps()
        for path in self._logs(0):  # logs older than every kept snapshot are not needed
            if kept and int(path.stem) < kept[0]:
                path.unlink(missing_ok=True)
        if kept and self.state.store is not None:  # nor pushes merged before all of them
            self.state.store.purge(kept[0])
        self.snapshots += 1
        self.snapshot_time_s += time.perf_counter() - t0
        runtime.trim_memory()  # Orbax's copy of the state is freed now: give it back

    def _run(self) -> None:
        state = self.state
        while not self._stop.is_set():
            with state.lock:
                retired, self._retired = self._retired, []
                for log in retired:  # synced when replaced; no sync of ours still uses it
                    try:
                        log.close()
                    except OSError as error:  # (its records were synced before it retired)
                        logging.error("syncer: closing an old log failed: %s", error)
                if state.seq <= state.committed_seq:
                    state.lock.wait(0.05)
                    continue
                target = state.seq
                published = {
                    p: (state.fragments[p].version, state.fragments[p].values) for p in state.owned
                }
                log = state.wal
            try:
                t0 = time.perf_counter()
                log.sync()  # every change up to `target` is in this log or an older, synced one
                self.sync_s += time.perf_counter() - t0
                self.syncs += 1
                state.publish(target, published)
            except Exception as error:  # noqa: BLE001 - keep trying; nothing is acknowledged.
                logging.error("syncer commit failed: %s: %s", type(error).__name__, error)
                self._stop.wait(1.0)

    def _snapshots(self) -> None:
        while not self._stop.wait(0.05):
            every = max(self.snapshot_s, SNAPSHOT_DUTY * self._last_snapshot_s)
            if time.monotonic() - self._last_snapshot[1] < every:
                continue
            t0 = time.monotonic()
            try:
                self._snapshot()  # (nothing if the state has not changed since the last one)
            except Exception as error:  # noqa: BLE001 - the log still holds every change
                logging.error("syncer snapshot failed: %s: %s", type(error).__name__, error)
                # The next try is as far off as after a success (a full disk, say, does not
                # get a multi-GB write every second).
                self._last_snapshot = (self._last_snapshot[0], time.monotonic())
                self._last_snapshot_s = max(self._last_snapshot_s, time.monotonic() - t0)

    def stats(self) -> dict[str, Any]:
        """Counts and mean times of log syncs and snapshots."""
        return {
            "syncs": self.syncs,
            "sync_mean_s": self.sync_s / max(self.syncs, 1),
            "snapshots": self.snapshots,
            "snapshot_mean_s": self.snapshot_time_s / max(self.snapshots, 1),
            "replayed_records": self.replayed,
        }

    def stop(self) -> None:
        """Stops after the current commit; closes the log and the checkpointer."""
        self._stop.set()
        for thread in (self._thread, self._snapshotter):
            if thread.is_alive():
                thread.join()
        retired, self._retired = self._retired, []
        for log in retired:
            log.close()
        if self.state.wal is not None:
            self.state.wal.close()
            self.state.wal = None
        self.checkpointer.close()
