"""A learner's recovery: Orbax checkpoints, the data journal, and the schedule after a restart.

Checkpoint (every `checkpoint.every` steps and at the last step, asynchronous): the inner
state (parameters and inner optimizer state), every `Learner.checkpoint_items()` pytree (the
error-feedback residual), and JSON metadata: step, tokens, the data iterator's state and
position, per-fragment versions, rounds and counters, and the recovery counters below.

Restart (`restore`): the newest readable checkpoint is restored (an unreadable one is skipped,
see `IslandCheckpointer`), newer ones are discarded so that saving can go on; then the learner
takes the current global fragments and versions from the syncer (it pulled them in `connect`),
overwriting the restored parameters, and starts its per-fragment counters and rounds afresh
(a re-registration is a new incarnation at the syncer).

The data rule: a learner never trains on a batch twice, and skips none silently. Every batch
drawn bumps `data_position`, which is written to a small journal file next to the checkpoints
after each draw (a write to the page cache: it survives the process being killed). A restart
restores the iterator to the checkpointed position and then draws and discards the batches up
to the journal's position: the batches of the steps done after the last checkpoint, whose
work is lost with the process. Their data is skipped, not replayed (part of that work reached
the syncer in pushes made after the checkpoint, so training on it again would count it twice);
the skip is logged and counted (`skipped_batches`, `lost_steps` in the learner's summary).
That rule is for static shards. With data leases (`learner.leases`) the data position is the
syncer's: a restart asks for a lease, and the lease it held is handed again from the first
batch its accepted pushes do not cover (`syncer.ledger`); nothing is skipped, and the
checkpoint holds no data state.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from decoupled_diloco.checkpointing import IslandCheckpointer

T = TypeVar("T")


_PHASES = (
    ("constructing", "imports"),
    ("connected", "build+connect"),
    ("data_loaded", "data"),
    ("restored", "restore or init"),
    ("first_step", "first step"),
)


def startup_line(times: dict[str, float]) -> str:
    """'first step 4.1 s after the process started: imports 2.0 s, ...' from wall times.

    A warm standby (`standby`) counts from its activation (`activated`): what is left of its
    warm-up if it was activated before it was ready, then the activation itself (flags, log),
    and the same phases as a new process.
    """
    phases, origin = _PHASES, times["process_start"]
    what = "the process started"
    if "activated" in times:
        origin = times["activated"]
        what = (
            f"activation of a warm standby (started {origin - times['process_start']:.1f} s before)"
        )
        phases = (
            ("standby_ready", "rest of warm-up"),
            ("constructing", "activation"),
            *_PHASES[1:],
        )
    parts, last = [], origin
    for key, label in phases:
        if key in times and not (key == "standby_ready" and times[key] <= origin):
            parts.append(f"{label} {times[key] - last:.2f} s")
            last = times[key]
    total = times.get("first_step", last) - origin
    return f"first step {total:.2f} s after {what}: " + ", ".join(parts)


class DataJournal:
    """The number of batches a learner has drawn, rewritten in place after every draw."""

    def __init__(self, path: pathlib.Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def read(self) -> int:
        """The last position written (0 for a new journal)."""
        text = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else 0

    def write(self, position: int) -> None:
        """Records `position` (fixed width: one small write, no truncation)."""
        os.pwrite(self._fd, f"{position:>20}\n".encode(), 0)

    def close(self) -> None:
        """Closes the file."""
        os.close(self._fd)


def _abstract(tree: Any) -> Any:
    """A restore target with the shapes, dtypes and shardings of `tree`'s arrays."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


class LearnerCheckpoints:
    """Checkpoints, restore and the data journal of one learner (see the module doc).

    Args:
      directory: this learner's checkpoint directory; the journal is `directory.progress`.
      every: steps between checkpoints (the last step is always saved).
      max_to_keep: newest checkpoints kept.
    """

    def __init__(self, directory: str | pathlib.Path, every: int, max_to_keep: int = 3):
        directory = pathlib.Path(directory).absolute()
        self.every = every
        self.checkpointer = IslandCheckpointer(directory, max_to_keep)
        self.journal = DataJournal(directory.with_name(directory.name + ".progress"))
        self.save_s = 0.0

    def due(self, step: int, last_step: int) -> bool:
        """Whether to checkpoint after `step`."""
        return step % self.every == 0 or step == last_step

    def drew(self, position: int) -> None:
        """Records that `position` batches have been drawn (call after each draw)."""
        self.journal.write(position)

    def save(self, learner: Any, state: Any, batches: Any) -> None:
        """Starts an asynchronous checkpoint of `learner` after its current step.

        `batches`: the static shard's iterator (its position is saved), or None (leases).
        """
        t0 = time.perf_counter()
        meta = {
            "step": learner.step,
            "tokens": learner.tokens,
            "data": None if batches is None else batches.get_state(),
            "data_position": learner.data_position,
            "versions": list(learner.sync.versions),
            "rounds": [f.round for f in learner.sync.states],
            "steps_since": [f.steps_since for f in learner.sync.states],
            "tokens_since": [f.tokens_since for f in learner.sync.states],
            "skipped_batches": learner.skipped_batches,
            "lost_steps": learner.lost_steps,
            "restarts": learner.restarts,
            "wall_time": time.time(),
        }
        self.checkpointer.save(learner.step, {"inner": state, **learner.checkpoint_items()}, meta)
        self.save_s += time.perf_counter() - t0

    def restore(self, learner: Any, init: Callable[[], Any], batches: Any) -> Any:
        """Restores the newest readable checkpoint into `learner` and `batches`.

        `batches`: the static shard's iterator (restored to the saved position, then the
        batches drawn after it skipped), or None (data leases: no data state).

        Returns:
          The inner state to train on: the restored one, else `init()` (a fresh start, or no
          readable checkpoint). The caller then overwrites its parameters with the syncer's
          global fragments.
        """
        drawn = self.journal.read() if batches is not None else 0
        items = learner.checkpoint_items()
        target = {"inner": learner.island.abstract_state, **_abstract(items)}
        found = self.checkpointer.restore_latest(target)
        step = found[0] if found else 0
        self.checkpointer.discard_after(step)
        if found is None:
            state = init()
        else:
            _, tree, meta = found
            state = tree["inner"]
            learner.restore_items({name: tree[name] for name in items})
            if batches is not None:
                batches.set_state(meta["data"])
            learner.step, learner.tokens = meta["step"], meta["tokens"]
            learner.data_position = meta["data_position"]
            learner.skipped_batches = meta["skipped_batches"]
            learner.lost_steps = meta["lost_steps"]
            learner.restarts = meta["restarts"] + 1
            learner.restored_from_step = step
        if found is None and drawn:
            learner.restarts = 1  # killed before its first checkpoint
        skip = max(drawn - learner.data_position, 0)
        for _ in range(skip):  # the batches of the lost steps: skipped, never replayed
            next(batches)
        learner.data_position += skip
        learner.skipped_batches += skip
        learner.lost_steps += skip
        self.journal.write(learner.data_position)
        if found is not None or skip:
            what = f"restored step {step}" if found is not None else "no checkpoint yet"
            print(
                f"[learner {learner.id}] {what} (restart {learner.restarts}); {skip} batches "
                f"drawn after it were skipped with their lost steps (data position "
                f"{learner.data_position})",
                flush=True,
            )
        return state

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Waits for pending saves; closes the journal."""
        self.checkpointer.close()
        self.journal.close()
