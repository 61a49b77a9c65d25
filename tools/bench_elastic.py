r"""Elastic membership: a run that grows and shrinks, and the windows a failure loses.

  python -m tools.bench_elastic --out=benchmarks/results/elastic.md

Every run is a real `python -m experiments.train` process tree (a syncer and one process per
learner on 127.0.0.1, data leases: `decoupled.data_shards`); joins and leaves come from the
chaos schedule (`join`: a new learner process; `leave`: SIGTERM, a graceful leave), kills are
real `kill -9`s.

1. Membership 4 -> 6 -> 3 against a fixed 4, at the same token budget (M=4 · `--steps`
   batches): learners 4 and 5 join when learner 0 reaches step `--join_at`; learners 0, 1 and 2
   leave, each at its own step `--leave_at`. Wall time, goodput, final eval loss (target:
   within 1.5% of the fixed run's) and the data ledger.
2. Under the MTBF schedule of the resilience benchmark (each learner killed every `--mtbf` s
   on average, repaired in `--repair` s; the same seeded schedule twice): windows lost on
   data leases (the ledger's `missing`, 0 by construction, checked) against the batches the
   static-shard design skipped in the same schedule (`skipped_batches`: drawn after a
   learner's last checkpoint, never trained into the model).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

from tools.benchkit import ROOT, Section, train
from tools.benchkit.runs import FAST_CACHE

CONFIG = "experiments/configs/tiny_lm_decoupled.py"


def _schedule(path: pathlib.Path, join_at: int, leave_at: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# 4 -> 6 -> 3: two learners join, then three leave (each at its own step).\nfaults:\n"
        + "".join(f"  - {{at_step: {join_at}, kind: join, learner: {i}}}\n" for i in (4, 5))
        + "".join(f"  - {{at_step: {leave_at}, kind: leave, learner: {i}}}\n" for i in (0, 1, 2))
    )
    return str(path)


def run(workdir: pathlib.Path, config: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One run under membership changes or faults (`benchkit.train`)."""
    return train(workdir, config, overrides, tag="bench_elastic", env=FAST_CACHE)


def _ledger(s: dict[str, Any]) -> str:
    d = s.get("data_ledger")
    if not d:
        return "-"
    return (
        f"{d['consumed_once']:,} / {d['windows']:,} once, {d['missing']} missing, "
        f"{d['repeated']} repeated, {d['leases_handed_again']} leases handed again"
    )


def membership_scenario(
    args: argparse.Namespace, root: pathlib.Path, section: Section
) -> list[str]:
    """Fixed 4 vs 4 -> 6 -> 3 at the same token budget, for each seed."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.local import runs

    schedule = _schedule(root / "elastic.yaml", args.join_at, args.leave_at)
    rows, ratios, notes = [], [], []
    for seed in args.seeds:
        common = {
            "num_learners": 4, "train_steps": args.steps, "eval.every": 0, "log_every": 100,
            "decoupled.max_learners": 6, "seed": seed,
        }  # fmt: skip
        if args.global_batch:
            common["decoupled.global_batch"] = args.global_batch
        tag = "" if seed == 0 else f"_seed{seed}"
        fixed = run(root / f"fixed4{tag}", CONFIG, common)
        elastic = run(root / f"elastic{tag}", CONFIG, {**common, "chaos": schedule})
        ratios.append(elastic["final_eval_loss"] / fixed["final_eval_loss"])
        for name, s in (("fixed 4", fixed), ("4 -> 6 -> 3", elastic)):
            rows.append(
                f"| {seed} | {name} | {s['wall_s']:.0f} | {s['goodput']:.3f} | {s['uptime']:.3f} "
                f"| {s['tokens']:,} | {s['final_eval_loss']:.4f} | {_ledger(s)} |"
            )
        counts = {x["learner_id"]: x["steps"] for x in elastic["learners"]}
        events = [f"{e['event']} {e['learner']}" for e in elastic.get("membership", [])]
        notes.append(f"seed {seed}: steps per learner {counts}; membership {', '.join(events)}")
    shards = config_lib.lease_shards(runs.resolve(CONFIG, common))
    mean = sum(ratios) / len(ratios)
    section.claim(
        f"elastic 4->6->3 / fixed 4 final eval loss, mean of {len(ratios)} seeds",
        round(mean, 4),
        unit="×",
        goal="≤ 1.015",
        met=mean <= 1.015,
        section="1. Membership 4 -> 6 -> 3 vs a fixed 4",
    )
    lines = [
        f"### 1. Membership 4 -> 6 -> 3 vs a fixed 4 (budget {4 * args.steps:,} batches)",
        "",
        f"tiny_lm_decoupled (its defaults), M=4 starting, {args.steps} steps' worth of batches "
        f"per starting learner, {shards} data leases. Learners 4 and 5 join (fresh inner "
        f"optimizer state) at learner 0's step {args.join_at}; learners 0, 1, 2 leave "
        f"(SIGTERM) each at its own step {args.leave_at}. Global batch: "
        f"{runs.resolve(CONFIG, common).decoupled.global_batch} (`decoupled.global_batch`).",
        "",
        "| seed | run | wall s | goodput | uptime | tokens | final eval loss | data ledger |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Final eval loss ratio elastic / fixed: "
        + ", ".join(f"seed {s}: **{r:.4f}**" for s, r in zip(args.seeds, ratios, strict=True))
        + f"; mean **{sum(ratios) / len(ratios):.4f}** (target ≤ 1.015).",
        "",
        *[f"- {n}" for n in notes],
        "",
    ]
    return lines


def mtbf_scenario(args: argparse.Namespace, root: pathlib.Path, section: Section) -> list[str]:
    """The same failure schedule on data leases and on static shards: windows lost."""
    schedule = root / "mtbf.yaml"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    schedule.write_text(
        f"seed: {args.seed}\nfailure_model: {{mtbf_s: {args.mtbf}, repair_s: {args.repair}, "
        f"duration_s: {args.horizon}}}\n"
    )
    common = {
        "num_learners": 4, "train_steps": args.steps, "eval.every": 0, "log_every": 100,
        "checkpoint.every": args.ckpt, "chaos": str(schedule), "seed": args.seed,
    }  # fmt: skip
    leased = run(root / "mtbf_leases", CONFIG, common)
    static = run(root / "mtbf_static", CONFIG, {**common, "decoupled.data_shards": 0})
    window = leased["config"]["data"]["batch_size"]
    skipped = sum(x["skipped_batches"] for x in static["learners"])
    ledger = leased["data_ledger"]
    section.claim(
        f"windows lost under MTBF {args.mtbf:.0f} s, data on leases",
        ledger["missing"],
        unit="windows",
        headline=True,
        baseline=f"static shards {skipped * window:,} ({skipped} batches skipped)",
        note=f"{ledger['repeated']} trained twice",
        section="2. Windows lost under the MTBF schedule",
    )
    lines = [
        f"### 2. Windows lost under the MTBF schedule (mtbf {args.mtbf:.0f} s, repair "
        f"{args.repair:.0f} s)",
        "",
        f"tiny_lm_decoupled, M=4, {args.steps} steps per learner, checkpoints every {args.ckpt} "
        f"steps; `failure_model: {{mtbf_s: {args.mtbf}, repair_s: {args.repair}, duration_s: "
        f"{args.horizon}}}`, seed {args.seed}, the same schedule for both runs.",
        "",
        "| data | faults | lost steps (compute) | windows lost | wall s | goodput | final eval "
        "loss | data ledger |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        f"| leases | {leased['failures_injected']} | {leased['lost_steps']} | "
        f"**{leased['data_ledger']['missing']}** | {leased['wall_s']:.0f} | "
        f"{leased['goodput']:.3f} | {leased['final_eval_loss']:.4f} | {_ledger(leased)} |",
        f"| static shards | {static['failures_injected']} | {static['lost_steps']} | "
        f"**{skipped * window:,}** ({skipped} batches skipped) | {static['wall_s']:.0f} | "
        f"{static['goodput']:.3f} | {static['final_eval_loss']:.4f} | - |",
        "",
        "Static shards: a restarted learner skips the batches it drew after its last checkpoint "
        "(the data rule: never trained twice, so lost); on leases the next holder of a dead "
        "learner's lease trains them from the last accepted push, so its lost steps are "
        "compute, not data.",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench_elastic"))
    parser.add_argument("--only", default="membership,mtbf")
    parser.add_argument("--steps", type=int, default=300, help="batches per starting learner")
    parser.add_argument("--join_at", type=int, default=50)
    parser.add_argument("--leave_at", type=int, default=150)
    parser.add_argument("--ckpt", type=int, default=20)
    parser.add_argument("--mtbf", type=float, default=60.0)
    parser.add_argument("--repair", type=float, default=10.0)
    parser.add_argument("--horizon", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0, help="MTBF: the schedule's and run's")
    parser.add_argument(
        "--global_batch", default="", choices=["", "per_learner", "constant"],
        help="membership: decoupled.global_batch of both runs ('': the config's)",
    )  # fmt: skip
    parser.add_argument(
        "--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1],
        help="membership: the seeds of the fixed/elastic pairs",
    )  # fmt: skip
    args = parser.parse_args()
    root = pathlib.Path(args.workroot)
    section = Section("elastic")
    body: list[str] = []
    for name, scenario in (("membership", membership_scenario), ("mtbf", mtbf_scenario)):
        if name in args.only:
            body += scenario(args, root, section)
            lines = [
                "## Elastic membership and the data ledger (issue 21)",
                "",
                f"{section.header()} Load average {os.getloadavg()[0]:.1f} at the end. "
                "Definitions: docs/chaos.md.",
                "",
                *body,
            ]
            section.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
