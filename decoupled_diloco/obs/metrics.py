"""Run outputs: `metrics.jsonl` (one JSON object per event), `summary.json`, progress lines."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Any, TextIO

from decoupled_diloco.obs.tb import TensorBoardWriter


class MetricsWriter:
    """Writes one JSON object per event to `workdir/metrics.jsonl`, flushed at once.

    Args:
      workdir: the run directory.
      resume_step: the step training resumes from. Events up to it are kept, so a stopped and
        resumed run has one history; later ones (logged after the checkpoint the run resumed
        from) are dropped, since they are about to be logged again.
      tensorboard: also write each event as TensorBoard scalars under `workdir/tb` (see `tb`).
    """

    def __init__(self, workdir: str | pathlib.Path, resume_step: int = 0, tensorboard: bool = True):
        self.tb = TensorBoardWriter(workdir, resume_step) if tensorboard else None
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line + "\n")
                except json.JSONDecodeError:  # A line cut short by a crash.
                    continue
        with self.path.open("w") as rewrite:
            rewrite.writelines(kept)
        # Append mode from here: other writers (the chaos supervisor's fault and recovery events)
        # may append to the same file, and no line may overwrite another.
        self._file = self.path.open("a")

    def write(self, **event: Any) -> None:
        """Writes one event; non-finite floats become null so every line stays valid JSON."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in event.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.tb:
            self.tb.write(clean)

    def close(self) -> None:
        """Closes the file (and the TensorBoard event files)."""
        self._file.close()
        if self.tb:
            self.tb.close()


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
