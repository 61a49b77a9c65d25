"""Multi-process islands against single-process islands of the same devices: final eval loss.

  python -m tools.bench_multihost --out=benchmarks/results/multihost.md

Two learner islands, each a (2, 1) mesh: once as one process with 2 devices per island, once as
2 processes with 1 device each on JAX's distributed runtime (`decoupled.island_processes=2`,
gloo collectives on 127.0.0.1). Same data, seed, schedule and token budget. Quorum K = M and an
overlap of several steps make the merges as independent of timing as the asynchronous mode
allows, so that what remains is the difference the process split itself makes.

Target (issue 9): the multi-process run's final eval loss within 1% of the single-process one.
A finished run is reused; delete its directory under runs/bench_multihost to rerun it.
"""

from __future__ import annotations

import argparse
import pathlib

from tools.benchkit import ROOT, Section, train

SETTING = {
    "mode": "decoupled",
    "num_learners": 2,
    "inner_steps": 16,
    "train_steps": 160,
    "model.d_model": 64,
    "model.mlp_hidden": 128,
    "model.num_heads": 2,
    "model.seq_len": 64,
    "mesh.shape": "(2,1)",
    "decoupled.fragments": 2,
    "decoupled.overlap_steps": 4,
    "decoupled.quorum": 2,
    "eval.every": 0,
    "eval.batches": 8,
    "checkpoint.every": 0,
    "log_every": 40,
}


# One island whose merges come back well within tau (no other learner to wait for): the schedule
# of merges is fixed, so 1 and 2 processes should give the same run up to float rounding.
FIXED = {"num_learners": 1, "decoupled.quorum": 1, "decoupled.overlap_steps": 8}


def run(
    processes: int,
    seed: int,
    workroot: pathlib.Path,
    steps: int,
    tag: str = "",
    extra: dict | None = None,
) -> dict:
    """One `python -m experiments.train` run (or its finished output)."""
    workdir = workroot / f"p{processes}_seed{seed}_steps{steps}{tag}"
    args = {**SETTING, **(extra or {}), "train_steps": steps, "seed": seed}
    args["decoupled.island_processes"] = processes
    result = train(workdir, "experiments/configs/tiny_lm.py", args, tag="bench_multihost")
    return {"cmd": result["command"], **result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/multihost.md")
    parser.add_argument("--seeds", default="0,1", help="comma-separated")
    parser.add_argument("--steps", type=int, default=SETTING["train_steps"])
    parser.add_argument("--workroot", default="runs/bench_multihost")
    args = parser.parse_args(argv)
    workroot = (ROOT / args.workroot).absolute()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rows = []
    for seed in seeds:
        single = run(1, seed, workroot, args.steps)
        multi = run(2, seed, workroot, args.steps)
        rel = multi["final_eval_loss"] / single["final_eval_loss"] - 1
        rows.append((seed, single, multi, rel))
    # The noise floor: the first single-process run again (asynchronous merges depend on timing).
    again = run(1, seeds[0], workroot, args.steps, tag="_again")
    noise = again["final_eval_loss"] / rows[0][1]["final_eval_loss"] - 1
    fixed = [run(p, seeds[0], workroot, args.steps, "_fixed", FIXED) for p in (1, 2)]
    fixed_rel = fixed[1]["final_eval_loss"] / fixed[0]["final_eval_loss"] - 1
    mean_single = sum(r[1]["final_eval_loss"] for r in rows) / len(rows)
    mean_multi = sum(r[2]["final_eval_loss"] for r in rows) / len(rows)
    mean_rel = mean_multi / mean_single - 1
    section = Section("multihost", argv)
    section.claim(
        "final eval loss, 2 vs 1 processes per island (mean)",
        round(100 * mean_rel, 2),
        unit="%",
        baseline=f"1 process/island {mean_single:.4f}",
        goal="mean within 1%",
        met=abs(mean_rel) <= 0.01,
        section="Multi-process islands (issue 9)",
    )
    lines = [
        "## Multi-process islands (issue 9)\n",
        f"{section.header()} Two islands of a (2, 1) "
        "mesh each: 1 process x 2 devices against 2 processes x 1 device "
        "(`decoupled.island_processes=2`, jax.distributed + gloo on 127.0.0.1); tiny_lm at "
        "d_model 64, "
        f"H={SETTING['inner_steps']}, P=2, tau=4, quorum 2, {args.steps} steps per learner.\n",
        "| seed | final eval loss, 1 process/island | 2 processes/island | difference | "
        "wall s (1 / 2) |",
        "|---|---|---|---|---|",
    ]
    for seed, single, multi, rel in rows:
        lines.append(
            f"| {seed} | {single['final_eval_loss']:.4f} | {multi['final_eval_loss']:.4f} | "
            f"{100 * rel:+.2f}% | {single['wall_s']:.0f} / {multi['wall_s']:.0f} |"
        )
    lines.append(f"| mean | {mean_single:.4f} | {mean_multi:.4f} | {100 * mean_rel:+.2f}% | |\n")
    verdict = "met" if abs(mean_rel) <= 0.01 else "NOT met"
    lines.append(
        f"Run-to-run noise of the same single-process run (seed {seeds[0]}, run twice): "
        f"{again['final_eval_loss']:.4f} vs {rows[0][1]['final_eval_loss']:.4f} "
        f"({100 * noise:+.2f}%).\n"
    )
    lines.append(
        f"One island on a fixed merge schedule ({FIXED}; seed {seeds[0]}): final eval loss "
        f"{fixed[0]['final_eval_loss']:.5f} with 1 process, {fixed[1]['final_eval_loss']:.5f} "
        f"with 2 ({100 * fixed_rel:+.3f}%); merges {fixed[0]['outer_syncs']} / "
        f"{fixed[1]['outer_syncs']}.\n"
    )
    lines.append(f"Target (mean within 1%): **{verdict}**.\n")
    lines.append("Command of each run:\n")
    lines += [f"    {r[1]['cmd']}\n    {r[2]['cmd']}" for r in rows]
    lines.append(f"    {again['cmd']}")
    lines += [f"    {r['cmd']}" for r in fixed]
    section.write(ROOT / args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
