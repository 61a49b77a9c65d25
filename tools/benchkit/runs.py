"""Training runs for benchmarks: run or reuse, with a time cap, and what a run left behind.

Every run is `python -m experiments.train` as a user types it (`local.runs.run_or_reuse`): a
finished run of the very same config is reused, anything else in its directory is cleared
first. A run with a cap (a fault benchmark's window) is killed at the cap and accounted from
its timeline; that accounting is kept beside it, with the arguments that made it, for reuse.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from decoupled_diloco.local import runs
from decoupled_diloco.obs import timeline as timeline_lib

# Each restart of a fault benchmark compiles from the persistent cache, however small the entry.
FAST_CACHE = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def train(
    workdir: pathlib.Path,
    config_file: str | pathlib.Path,
    overrides: Mapping[str, Any],
    cap_s: float | None = None,
    tag: str = "bench",
    shown_root: pathlib.Path | None = None,
    env: Mapping[str, str] = (),
) -> dict[str, Any]:
    """One run of `config_file` with `overrides` in `workdir` (or its reused result).

    Args:
      workdir: the run's directory.
      config_file: the config file, relative to the repository or absolute.
      overrides: `--config.KEY=VALUE` overrides, by dotted key.
      cap_s: kill the run after this many seconds (None: it runs to the end).
      tag: the progress line's prefix.
      shown_root: shown as `runs/bench` in the recorded command (a reader's path).
      env: environment variables added to the run's.

    Returns:
      The run's summary with `command`, `metrics` (its metrics.jsonl records) and `capped`;
      for a run stopped at its cap, the timeline's accounting of its window instead (goodput,
      uptime, lost steps, faults and recoveries, steps done).

    Raises:
      subprocess.CalledProcessError: an uncapped run failed (its log is `workdir/train.log`).
    """
    workdir = pathlib.Path(workdir)
    if cap_s is not None:
        return _capped(workdir, config_file, overrides, cap_s, tag, env)
    summary = runs.run_or_reuse(config_file, overrides, workdir, tag=tag, env=env)
    if shown_root is not None:
        summary["command"] = summary["command"].replace(str(shown_root), "runs/bench")
    summary["metrics"] = metrics(workdir)
    summary["capped"] = False
    return summary


def metrics(workdir: pathlib.Path) -> list[dict[str, Any]]:
    """The run's `metrics.jsonl` records (a torn last line left out)."""
    out = []
    path = pathlib.Path(workdir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _key(config_file: str | pathlib.Path, overrides: Mapping[str, Any], cap_s: float) -> str:
    """What makes two capped runs the same: the whole config they resolve to, and the cap.

    A chaos schedule counts by its file name (the directory it is in may differ).
    """
    resolved = dataclasses.asdict(runs.resolve(config_file, overrides))
    if resolved["chaos"]:
        resolved["chaos"] = pathlib.Path(resolved["chaos"]).name
    return json.dumps({"config": resolved, "cap_s": cap_s}, sort_keys=True)


def _capped(
    workdir: pathlib.Path,
    config_file: str | pathlib.Path,
    overrides: Mapping[str, Any],
    cap_s: float,
    tag: str,
    env: Mapping[str, str],
) -> dict[str, Any]:
    key = _key(config_file, overrides, cap_s)
    done, args = workdir / "bench_result.json", workdir / "bench_key.json"
    if done.exists() and args.exists() and args.read_text() == key:
        print(f"[{tag}] reusing {workdir} (capped at {cap_s:.0f} s)", flush=True)
        return json.loads(done.read_text())
    t0 = time.monotonic()
    summary = runs.run_or_reuse(config_file, overrides, workdir, tag=tag, cap_s=cap_s, env=env)
    if summary is not None:  # it finished inside its cap
        summary["metrics"], summary["capped"] = metrics(workdir), False
        return summary
    records = metrics(workdir)
    result = timeline_lib.analyze(timeline_lib.load(workdir / "timeline"), t_end=time.time())
    steps = [timeline_lib.current_step(p) for p in (workdir / "timeline").glob("*.jsonl")]
    accounting = {
        "capped": True,
        "wall_s": time.monotonic() - t0,
        "goodput": result.goodput,
        "uptime": result.uptime,
        "lost_steps": result.lost_steps,
        "failures_injected": sum(r.get("event") == "fault" for r in records),
        "recoveries": sum(r.get("event") == "recovery" for r in records),
        "steps_done": max(steps, default=-1),
        "final_eval_loss": None,
        "timeline": result.as_dict(),
    }
    done.write_text(json.dumps(accounting))
    args.write_text(key)
    return accounting
