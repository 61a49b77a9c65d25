"""Run outputs: `metrics.jsonl` (one JSON object per event), `summary.json`, progress lines.

`metrics.jsonl` is the run's own record (reports, the simulator's calibration and tests read
it); the same events go, as named scalars, to the metric writers (`obs.writers`).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from decoupled_diloco import config as config_lib
from decoupled_diloco.obs import writers as writers_lib
from decoupled_diloco.obs.tb import TensorBoardWriter


class MetricsWriter:
    """Writes one JSON object per event to `workdir/metrics.jsonl`, flushed at once.

    Args:
      workdir: the run directory.
      resume_step: the step training resumes from. Events up to it are kept, so a stopped and
        resumed run has one history; later ones (logged after the checkpoint the run resumed
        from) are dropped, since they are about to be logged again.
      writers: metric writers (`obs.writers`) that get every event as named scalars; they are
        closed with this one.
    """

    def __init__(
        self,
        workdir: str | pathlib.Path,
        resume_step: int = 0,
        writers: Sequence[writers_lib.MetricWriter] = (),
    ):
        self.writers = list(writers)
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        # Append mode: the chaos supervisor's fault and recovery events go to the same file.
        self._file = writers_lib.open_resumed(self.path, resume_step)

    def write(self, **event: Any) -> None:
        """Writes one event; non-finite floats become null so every line stays valid JSON."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in event.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        for step, scalars in writers_lib.event_scalars(clean):
            for writer in self.writers:
                writer.write_scalars(step, scalars)
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Closes the file and the writers."""
        self._file.close()
        writers_lib.close_all(self.writers)


def make_writers(
    config: Any, workdir: str | pathlib.Path, resume_step: int = 0
) -> list[writers_lib.MetricWriter]:
    """The writers `config.metrics.writers` names, for a run in `workdir` resumed at `resume_step`.

    A resumed run replaces what an earlier one logged after `resume_step` (everything, for a
    fresh run) where the format allows it: TensorBoard purges those steps, `scalars.jsonl`
    drops those lines; a W&B run is resumed under its id (`workdir/wandb_run_id`) and keeps
    the points already sent.
    """
    workdir = pathlib.Path(workdir)
    writers: list[writers_lib.MetricWriter] = []
    for name in config_lib.metric_writers(config):
        if name == "tensorboard":
            main = "syncer" if config.mode == "decoupled" else "train"
            writers.append(TensorBoardWriter(workdir, resume_step, main_run=main))
        elif name == "jsonl":
            writers.append(writers_lib.JsonlWriter(workdir / "scalars.jsonl", resume_step))
        else:
            writers.append(writers_lib.WandbWriter(config, workdir, resume_step))
    return writers


def write_summary(workdir: str | pathlib.Path, summary: dict[str, Any]) -> pathlib.Path:
    """Writes `workdir/summary.json` atomically (write, then rename)."""
    path = pathlib.Path(workdir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


class Progress:
    """One line per log event: step, loss, eval loss, throughput and time left."""

    def __init__(self, label: str, total_steps: int, start_step: int = 0, out: TextIO = sys.stdout):
        self.label, self.total, self.start_step, self.out = label, total_steps, start_step, out
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the progress started."""
        return time.perf_counter() - self.t0

    def show(self, step: int, loss: float, tokens_per_s: float, eval_loss: float | None) -> None:
        """Prints one progress line."""
        done = step - self.start_step
        left = (self.total - step) * self.elapsed() / done if done else float("nan")
        eval_text = f" | eval {eval_loss:.3f}" if eval_loss is not None else ""
        print(
            f"[{self.label}] step {step}/{self.total} ({100 * step / self.total:3.0f}%) | "
            f"loss {loss:.3f}{eval_text} | {tokens_per_s / 1e3:.1f}k tok/s | "
            f"{self.elapsed():.0f}s elapsed, ~{left:.0f}s left",
            file=self.out,
            flush=True,
        )
