"""TensorBoard event files next to `metrics.jsonl`: `tensorboard --logdir WORKDIR/tb`.

Every metrics event becomes scalars (written with tensorboardX, no TensorFlow needed; names as
`writers.event_scalars` makes them), in one run directory per source:

- `dp`/`diloco`: `WORKDIR/tb/train` (global loss, eval loss, throughput, and each learner's
  loss as `learner_loss/I`).
- `decoupled`: `WORKDIR/tb/syncer` (the global model's eval loss, merges, fragment versions as
  `version/P`) and `WORKDIR/tb/learner_I` (that learner's loss and other `learner_*` values,
  at its own step), so TensorBoard overlays the learners as separate runs.

A run resumed at step S purges the events after S that an earlier run wrote (TensorBoard's
`purge_step`; a fresh run in a used directory purges them all), matching what `MetricsWriter`
keeps in `metrics.jsonl`.
"""

from __future__ import annotations

import pathlib
import struct
import time
from collections.abc import Mapping
from typing import Any

from decoupled_diloco.obs.writers import LEARNER_SERIES, close_within

TB_DIR = "tb"


class TensorBoardWriter:
    """Turns metrics events into TensorBoard scalars under `workdir/tb/RUN`.

    Args:
      workdir: the run directory (the one holding `metrics.jsonl`).
      resume_step: events after this step, written before a restart, are purged.
      main_run: the run of every name but `learner_I/NAME` ("train"; "syncer" in decoupled mode).
    """

    def __init__(self, workdir: str | pathlib.Path, resume_step: int = 0, main_run: str = "train"):
        self.main_run = main_run
        self.root = pathlib.Path(workdir) / TB_DIR
        self.resume_step = resume_step
        if resume_step == 0 and self.root.is_dir():  # a fresh run: no curve of an earlier one
            for old in self.root.glob("*/events.out.tfevents.*"):
                old.unlink()
        self._writers: dict[str, Any] = {}

    def _writer(self, run: str) -> Any:
        if run not in self._writers:
            from tensorboardX import SummaryWriter  # Imported when first needed (~0.3 s).

            self._writers[run] = SummaryWriter(
                str(self.root / run),
                # A rerun in the same directory replaces what an earlier one logged after
                # `resume_step` (everything, for a fresh run), as metrics.jsonl does.
                purge_step=self.resume_step + 1,
                flush_secs=5,
                # Event file names carry whole seconds: a nanosecond suffix keeps a quick rerun
                # from overwriting the previous file, and sorts after it.
                filename_suffix=f".{time.time_ns()}",
            )
        return self._writers[run]

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Writes `scalars` at `step`: `learner_I/NAME` as `NAME` of the run `learner_I`."""
        walltime = time.time()
        for name, value in scalars.items():
            match = LEARNER_SERIES.match(name)
            run, tag = match.groups() if match else (self.main_run, name)
            self._writer(run).add_scalar(tag, float(value), global_step=step, walltime=walltime)

    def flush(self) -> None:
        """Flushes every run's event file."""
        for writer in self._writers.values():
            writer.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        """Flushes and closes every run's event file, waiting at most `timeout_s` for each.

        Bounded: a Ctrl+C that lands inside tensorboardX's queue can leave its writer thread
        waiting for a stop signal that never arrives (seen on CI: the launcher's clean-up hung
        there); the file then misses at most its last values, and the run still ends.
        """
        for run, writer in self._writers.items():
            close_within(writer.close, timeout_s, f"the TensorBoard events of {run}")
        self._writers.clear()


def read_scalars(run_dir: str | pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of every event file in `run_dir`: {tag: [(step, value), ...]} in file order.

    A reader for tests and reports that need no TensorBoard install: event files are TFRecord
    streams (length, length CRC, `Event` proto, data CRC); the CRCs are not checked. A session
    start at step S drops the values at steps >= S read so far, as TensorBoard does (purge).
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(pathlib.Path(run_dir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            if len(record) < length:  # Cut short by a crash.
                break
            event = event_pb2.Event.FromString(record)
            if event.session_log.status == event_pb2.SessionLog.START:
                for tag, values in scalars.items():
                    scalars[tag] = [(s, v) for s, v in values if s < event.step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
