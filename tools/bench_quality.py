"""Quality: `diloco` against `dp` at equal total tokens on the default corpus (tiny_lm).

  python -m tools.bench_quality --out=benchmarks/results/quality.md [--short_only]

Every run is a real `python -m experiments.train` process on the same data, seed and token
budget; the final eval loss comes from its `summary.json` (32 fixed validation batches, the
same for every mode). The section is rewritten after each run, so a stopped benchmark keeps
what it measured.
"""

from __future__ import annotations

import argparse
import pathlib
import time

from tools.benchkit import ROOT, Section
from tools.benchkit.tiny import LONG, OUTER, SHORT, baseline


def render(results: dict[str, dict], section: Section) -> str:
    """The Markdown section for the runs done so far."""
    lines = [
        "## Quality: `diloco` vs `dp` at equal tokens (foundation issue)",
        "",
        f"{section.header()} Runs whose output already existed are reused, each listed with "
        "its own command below. tiny_lm on the "
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


def _claims(section: Section, results: dict[str, dict]) -> None:
    """The ratio of diloco with plain averaging (SGD 1.0/0.0) to dp, at M=2 and M=4."""
    for length in ("short", "long"):
        dp, diloco = results.get(f"{length}:dp"), results.get(f"{length}:diloco lr1.0-m0.0")
        if not dp or not diloco:
            continue
        section.claim(
            f"diloco (SGD 1.0/0.0) / dp final eval loss, M={dp['num_learners']}, "
            f"{dp['train_steps']:,} steps",
            round(diloco["final_eval_loss"] / dp["final_eval_loss"], 4),
            unit="×",
            baseline=f"dp {dp['final_eval_loss']:.4f}",
            section="Quality: `diloco` vs `dp` at equal tokens (foundation issue)",
        )


def _label(outer_cfg: tuple) -> str:
    lr, momentum, nesterov = outer_cfg
    return f"lr{lr}-m{momentum}" + ("-nesterov" if nesterov else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/quality.md")
    parser.add_argument("--short_only", action="store_true", help="skip the 2,000-step runs")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args()
    workroot = pathlib.Path(args.workroot)
    section = Section("quality")
    plan = [("short:dp", "dp", SHORT, OUTER[0])]
    plan += [(f"short:diloco {_label(o)}", "diloco", SHORT, o) for o in OUTER]
    if not args.short_only:
        plan.append(("long:dp", "dp", LONG, OUTER[0]))
        # Each 2,000-step run takes ~20 min here: the long sweep keeps the first two settings.
        plan += [(f"long:diloco {_label(o)}", "diloco", LONG, o) for o in OUTER[:2]]
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name, mode, setting, outer_cfg in plan:
        results[name] = baseline(name, mode, outer_cfg, workroot, setting)
        _claims(section, results)
        section.write(args.out, render(results, section))
    print(f"[bench_quality] total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
