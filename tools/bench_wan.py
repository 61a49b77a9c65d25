r"""`python -m tools.bench_wan --out=benchmarks/results/wan.md [--quick]`: training over WAN links.

Each decoupled run puts every learner in its own network namespace behind a kernel rate limit
(`decoupled.wan_mbit`, `decoupled_diloco.local.wan`; the in-process pacer where the kernel
cannot shape, and the table says which). The limits are the paper's 12B run over 5, 2, 1 and
0.5 Gbit/s scaled to this model by the ratio of communication to computation
(`sim.bandwidth.scaled_bandwidth`, with `PAPER_12B`'s assumptions): the step time is measured
by the unlimited run first. Compute utilisation is stepping time over the learners' time from
their first step on (stepping, blocked, checkpointing; start-up, compiling and the initial wait
excluded), from the timelines; "without the final flush" leaves out the blocked time after the
last step, which a long run amortises.

`dp` has no network in this framework (its M learners all-reduce inside one XLA program), so
its column is the planner's (`tools/plan_bandwidth`: a ring all-reduce of float32 gradients
every step, up to 2/3 of a step hidden behind the backward pass) at the measured step time: a
prediction, labelled as one.

`--quick`: only the scaled 2 Gbit/s and unlimited decoupled e3m0 P=4 runs (e3m0 pushes and
pulls: `compression.downlink`); it ends with
`scaled 2 Gbit/s: decoupled utilisation U, dp utilisation V (planned), shaping tbf|pacer`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from decoupled_diloco.local import wan
from decoupled_diloco.sim import bandwidth

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "experiments/configs/tiny_lm_decoupled.py"
SCALED_GBPS = (5.0, 2.0, 1.0, 0.5)
_FIRST_STEP_ON = ("stepping", "blocked", "checkpointing", "paused")


def _run(workdir: pathlib.Path, overrides: dict[str, object]) -> dict:
    """One run of `CONFIG` with `overrides`; its summary."""
    command = [sys.executable, "-m", "experiments.train", f"--config={CONFIG}", "--hints=False"]
    command += [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
    print("[bench_wan]", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return json.loads((workdir / "summary.json").read_text())


def utilisation(summary: dict) -> tuple[float, float]:
    """(utilisation, utilisation without the final flush) over the learners' training time.

    Computing = the timelines' `stepping` time less the link's own `blocked_s` (waits for the
    syncer inside the step loop, which the timeline counts as stepping).
    """
    stepping = busy = flush = blocked = 0.0
    for learner in summary["timeline"]["learners"].values():
        by = learner["by_state"]
        stepping += by.get("stepping", 0.0)
        busy += sum(by.get(s, 0.0) for s in _FIRST_STEP_ON)
    for learner in summary["learners"]:
        flush += learner.get("final_flush_s", 0.0)
        blocked += learner.get("blocked_s", 0.0)
    computing = stepping - blocked
    return computing / max(busy, 1e-9), computing / max(busy - flush, 1e-9)


def step_time(summary: dict) -> float:
    """Seconds per inner step, from the timelines: stepping time less the link's waits.

    Over the steps after the first, which compiles (`compiling` in the timeline).
    """
    stepping = sum(
        x["by_state"].get("stepping", 0.0) for x in summary["timeline"]["learners"].values()
    )
    blocked = sum(x.get("blocked_s", 0.0) for x in summary["learners"])
    steps = sum(max(x["steps"] - 1, 1) for x in summary["learners"])
    return (stepping - blocked) / steps


def dp_planned(params: float, step_s: float, gbps: float, learners: int) -> float:
    """The planner's dp utilisation: a float32 ring all-reduce every step."""
    plan = bandwidth.LinkPlan(
        params=params, step_time_s=step_s, inner_steps=1, fragments=1, overlap_steps=0,
        bits=32, dp_bits=32, num_learners=learners, topology="allreduce",
    )  # fmt: skip
    return bandwidth.utilisation(plan, "dp", gbps)


def decoupled_planned(params: float, step_s: float, gbps: float, inner_steps: int) -> float:
    """The planner's streaming utilisation: 4-bit fragments (e3m0), P = 4, τ = H // 5."""
    plan = bandwidth.LinkPlan(
        params=params, step_time_s=step_s, inner_steps=inner_steps, fragments=4,
        overlap_steps=inner_steps // 5, bits=4, topology="syncer",
    )  # fmt: skip
    return bandwidth.utilisation(plan, "streaming", gbps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wan.md"))
    parser.add_argument("--quick", action="store_true", help="the scaled 2 Gbit/s only")
    parser.add_argument("--workdir", default="runs/bench_wan")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m tools.bench_wan", *given])  # as run, to run it again
    ok, why = wan.available()
    shaping = "tbf" if ok else f"pacer ({why})"
    # e3m0 both ways (the merged fragments come back as differences from the learner's copy,
    # `compression.downlink`), as the paper's link carries 4-bit values each way.
    base = {
        "num_learners": args.learners, "train_steps": args.steps, "compression.scheme": "e3m0",
        "compression.downlink": True, "decoupled.fragments": 4,
    }  # fmt: skip
    root = pathlib.Path(args.workdir)
    t0 = time.time()
    free = _run(root / "unlimited", base)
    params = free["params"]
    step_s = step_time(free)
    tiny = bandwidth.Workload(params, free["inner_steps"], step_s)
    rows = [("unlimited", 0.0, free)]
    for gbps in (2.0,) if args.quick else SCALED_GBPS:
        mbit = bandwidth.scaled_bandwidth(gbps * 1e9, bandwidth.PAPER_12B, tiny) / 1e6
        limited = {**base, "decoupled.wan_mbit": round(mbit, 4)}
        rows.append((f"scaled {gbps:g} Gbit/s", mbit, _run(root / f"{gbps:g}gbps", limited)))
    lines = [
        "## WAN: decoupled training behind kernel rate limits\n",
        f"`{command}` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {time.time() - t0:.0f} s): {CONFIG}, "
        f"{args.learners} learners, {args.steps} steps, e3m0, "
        f"P = 4, H = {free['inner_steps']}; {params / 1e6:.2f}M parameters; step time "
        f"{step_s * 1e3:.0f} ms (unlimited run); shaping: {shaping}. The paper's side "
        "(`sim.bandwidth.PAPER_12B`): 12e9 parameters, H = 100 (Table 4's; assumed), 1 s steps "
        "(assumed, between Table 4's 10B and 100B).\n",
        "| link | rate here (Mbit/s) | utilisation | without final flush | planned | stall max "
        "| final eval loss | vs unlimited | MB sent | dp utilisation (planned) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_loss = free["final_eval_loss"]
    for name, mbit, s in rows:
        u, u_noflush = utilisation(s)
        dp = dp_planned(params, step_s, mbit / 1e3, args.learners) if mbit else 1.0
        h = free["inner_steps"]
        planned = decoupled_planned(params, step_s, mbit / 1e3, h) if mbit else 1.0
        lines.append(
            f"| {name} | {mbit:.3f} | {u:.3f} | {u_noflush:.3f} | {planned:.3f} | "
            f"{s['stall_fraction_max']:.4f} | "
            f"{s['final_eval_loss']:.4f} | {s['final_eval_loss'] / base_loss:.4f} | "
            f"{s['bytes_sent'] / 1e6:.1f} | {dp:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text)
    print(text)
    two = next(s for name, _, s in rows if name == "scaled 2 Gbit/s")
    mbit2 = next(m for name, m, _ in rows if name == "scaled 2 Gbit/s")
    print(
        f"scaled 2 Gbit/s: decoupled utilisation {utilisation(two)[0]:.3f}, dp utilisation "
        f"{dp_planned(params, step_s, mbit2 / 1e3, args.learners):.3f} (planned), shaping "
        f"{'tbf' if ok else 'pacer'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
