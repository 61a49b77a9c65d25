"""Quality: `diloco` against `dp` at equal total tokens on the default corpus (tiny_lm).

  python -m tools.bench_quality --out=benchmarks/results/quality.md [--short_only]

Every run is a real `python -m experiments.train` process on the same data, seed and token
budget; the final eval loss comes from its `summary.json` (32 fixed validation batches, the
same for every mode). The section is rewritten after each run, so a stopped benchmark keeps
what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import time

from decoupled_diloco.local.runs import run_or_reuse

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "experiments/configs/tiny_lm.py"
COMMON = {"eval.batches": 32, "eval.every": 500, "checkpoint.every": 0, "log_every": 100}
SHORT = {"num_learners": 2, "inner_steps": 50, "train_steps": 300}
LONG = {"num_learners": 4, "inner_steps": 50, "train_steps": 2000}
# Outer optimizer settings (lr, momentum, nesterov) swept for `diloco`: the DiLoCo default
# (0.7, 0.9, Nesterov), plain averaging (FedAvg: lr 1, no momentum) and a lighter momentum.
OUTER = ((0.7, 0.9, True), (1.0, 0.0, False), (0.7, 0.5, True))


def run(name: str, mode: str, setting: dict, outer_cfg: tuple, workroot: pathlib.Path) -> dict:
    """Runs one training process (or reuses its finished output) and returns its summary."""
    workdir = workroot / name.replace(":", "_").replace(" ", "_")
    lr, momentum, nesterov = outer_cfg
    overrides = {**COMMON, "mode": mode, "outer.lr": lr, "outer.momentum": momentum}
    overrides |= {"outer.nesterov": nesterov, **setting}
    # A finished run of the same config is reused; delete its dir to rerun.
    summary = run_or_reuse(CONFIG, overrides, workdir, tag="bench_quality")
    summary["command"] = summary["command"].replace(str(workroot), "runs/bench")
    return summary


def render(results: dict[str, dict], started: str) -> str:
    """The Markdown section for the runs done so far."""
    lines = [
        "## Quality: `diloco` vs `dp` at equal tokens (foundation issue)",
        "",
        f"Command: `python -m tools.bench_quality` (rendered {started}; runs whose output "
        "already existed are reused, each listed with its own command below). tiny_lm on the "
        "default corpus (Python stdlib), seed 0, AdamW 3e-3 with warmup and cosine decay; the "
        "outer optimizer of each `diloco` row is given as lr / momentum / nesterov. Final eval "
        "loss is over 32 fixed validation batches of 16 x 128 tokens (65,536 tokens), the same "
        "for every run. `dp` averages gradients over the same M learners' batches every step.",
        "",
        "| run | mode | M | H | steps/learner | tokens | outer lr / momentum / nesterov | "
        "final eval loss | "
        "ratio to dp | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        dp = results.get(name.split(":")[0] + ":dp")
        ratio = s["final_eval_loss"] / dp["final_eval_loss"] if dp else float("nan")
        o = s["config"]["outer"]
        lr = f"{o['lr']} / {o['momentum']} / {o['nesterov']}" if s["mode"] != "dp" else "-"
        lines.append(
            f"| {name} | {s['mode']} | {s['num_learners']} | {s['inner_steps']} | "
            f"{s['train_steps']} | {s['tokens']:,} | {lr} | {s['final_eval_loss']:.4f} | "
            f"{ratio:.4f} | {s['wall_s']:.0f} |"
        )
    lines += ["", "Commands of each run:", ""]
    lines += [f"- {name}: `{s['command']}`" for name, s in results.items()]
    lines.append("")
    return "\n".join(lines)


def _label(outer_cfg: tuple) -> str:
    lr, momentum, nesterov = outer_cfg
    return f"lr{lr}-m{momentum}" + ("-nesterov" if nesterov else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/quality.md")
    parser.add_argument("--short_only", action="store_true", help="skip the 2,000-step runs")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args()
    out, workroot = pathlib.Path(args.out), pathlib.Path(args.workroot)
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    plan = [("short:dp", "dp", SHORT, OUTER[0])]
    plan += [(f"short:diloco {_label(o)}", "diloco", SHORT, o) for o in OUTER]
    if not args.short_only:
        plan.append(("long:dp", "dp", LONG, OUTER[0]))
        # Each 2,000-step run takes ~20 min here: the long sweep keeps the first two settings.
        plan += [(f"long:diloco {_label(o)}", "diloco", LONG, o) for o in OUTER[:2]]
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name, mode, setting, outer_cfg in plan:
        results[name] = run(name, mode, setting, outer_cfg, workroot)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(results, started))
    print(render(results, started))
    print(f"[bench_quality] total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
