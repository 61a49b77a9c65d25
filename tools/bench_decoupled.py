"""Decoupled mode: quality against dp/diloco, learner stall, and a 3x-slower learner.

  python -m tools.bench_decoupled --out=benchmarks/results/decoupled.md

Every run is a real `python -m experiments.train` process (for `decoupled`: a syncer and two
learner processes on 127.0.0.1) on the default corpus with the tiny_lm config, M=2, H=50,
300 steps per learner, 32 fixed validation batches; the dp/diloco runs are the same commands
as `tools.bench_quality` (and reuse its finished runs). A finished run is reused; delete its
directory under runs/bench to rerun it.

Targets (issue 3): decoupled final eval loss ≤ 1.08 × dp; learner stall ≤ 1% of wall time;
with one learner 3x slower, decoupled reaches dp's final eval loss sooner than diloco.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

from tools.benchkit import ROOT, Section
from tools.benchkit.tiny import (
    LONG,
    SHORT,
    baseline,
    run,
    short_baselines,
    time_cells,
    time_header,
    time_to,
)
from tools.decoupled_variants import (
    DECOUPLED,
    FIXED_FROM,
    GATHER,
    KEEP5,
    LONG_DECOUPLED,
    M4_SHORT,
    SEEDS,
    SETTING,
    SGD1,
    SHARE,
    SLOW,
    SLOW_STEPS,
    SLOW_VARIANT,
    VARIANTS,
)


def _repeat_ratios(decoupled: dict[str, dict], dp_loss: float) -> list[float]:
    """Ratio to dp of each run of the repeated gather + share command."""
    return [
        s["final_eval_loss"] / dp_loss
        for name, s in decoupled.items()
        if name.startswith("gather + share, learner anchor")
    ]


def _spread(decoupled: dict[str, dict], dp_loss: float) -> list[str]:
    """The repeated gather + share runs: mean and range of their ratio to dp."""
    ratios = _repeat_ratios(decoupled, dp_loss)
    if len(ratios) < 2:
        return []
    mean = sum(ratios) / len(ratios)
    under = sum(r <= 1.08 for r in ratios)
    return [
        f"Gather + share, {len(ratios)} runs of the same command (every round gathered both "
        f"learners, before the fixes and after): ratio to dp mean {mean:.4f}, range "
        f"{min(ratios):.4f}-{max(ratios):.4f}, {under} of {len(ratios)} at or under the "
        "target (≤ 1.08).",
        "",
    ]


def _sizes(summary: dict) -> str:
    """How many merges held 1, 2, ... learners ("-" for dp and diloco)."""
    sizes = summary.get("merge_sizes")
    return ", ".join(str(n) for n in sizes[1:]) if sizes else "-"


def _seeds(workroot: pathlib.Path, dp: dict, diloco: dict, decoupled: dict[str, dict]) -> dict:
    """dp, diloco and decoupled gather + share at other seeds (init and data order differ)."""
    ratios0 = _repeat_ratios(decoupled, dp["final_eval_loss"])
    lines = [
        "### Other seeds: how much of the gap to diloco is the draw",
        "",
        "The same M=2 commands with `--config.seed` (the initial parameters and each learner's "
        "data order change; the validation batches do not). Seed 0 is the table above "
        f"(decoupled: the mean of its {len(ratios0)} gather + share runs).",
        "",
        "| seed | dp final eval loss | diloco / dp | decoupled gather + share / dp |",
        "|---|---|---|---|",
        f"| 0 | {dp['final_eval_loss']:.4f} | "
        f"{diloco['final_eval_loss'] / dp['final_eval_loss']:.4f} | "
        f"{sum(ratios0) / max(len(ratios0), 1):.4f} |",
    ]
    runs = []
    for seed in SEEDS:
        setting = {**SHORT, "seed": seed}
        s_dp = baseline(f"short_seed{seed}:dp", "dp", (0.7, 0.9, True), workroot, setting)
        s_diloco = baseline(
            f"short_seed{seed}:diloco lr1.0-m0.0", "diloco", (1.0, 0.0, False), workroot, setting
        )
        s_dec = run(
            f"decoupled_gather_share_seed{seed}",
            {"mode": "decoupled", **SETTING, **GATHER, **SHARE, "seed": seed},
            workroot,
        )
        base = s_dp["final_eval_loss"]
        lines.append(
            f"| {seed} | {base:.4f} | {s_diloco['final_eval_loss'] / base:.4f} | "
            f"{s_dec['final_eval_loss'] / base:.4f} |"
        )
        runs += [s_dp, s_diloco, s_dec]
    return {"lines": [*lines, ""], "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--skip_slow", action="store_true", help="skip the heterogeneity runs")
    parser.add_argument("--skip_long", action="store_true", help="skip the M=4 2,000-step runs")
    args = parser.parse_args()
    workroot = pathlib.Path(args.workroot)
    section = Section("decoupled")
    dp, diloco = short_baselines(workroot)
    rows, decoupled = [], {}
    fixed = False
    for name, overrides in VARIANTS:
        fixed = fixed or name == FIXED_FROM
        tag = name.replace(" ", "_").replace("/", "-").replace("=", "").replace(",", "")
        tag = tag.replace("τ", "tau")
        decoupled[name] = s = run(
            f"decoupled_{tag}", {"mode": "decoupled", **SETTING, **DECOUPLED, **overrides}, workroot
        )
        stall = max(x["stall_fraction"] for x in s["learners"])
        host = max(x["sync_host_fraction"] for x in s["learners"])
        rows.append(
            f"| decoupled {name}{'' if fixed else ' †'} | {s['final_eval_loss']:.4f} | "
            f"{s['final_eval_loss'] / dp['final_eval_loss']:.4f} | {s['outer_syncs']} | "
            f"{100 * stall:.3f}% | {100 * host:.2f}% | {s['wall_s']:.0f} |"
        )
    lines = [
        "## Decoupled mode: quality, learner stall, heterogeneity (issue 3)",
        "",
        f"{section.header()} Finished runs are reused. tiny_lm, M=2, H=50, 300 steps per "
        "learner, "
        "default corpus, 32 fixed "
        "validation batches; decoupled: P=4 fragments, τ=2, quorum 1 unless noted, RDA (mean for "
        "embeddings), "
        "token weights. Shared 2-core machine: wall times are noisy. Decoupled runs are not "
        "repeatable bit for bit (arrival order varies): the same `nesterov 0.7/0.9` command gave "
        "1.8407 and 1.8879 in two runs.",
        "",
        "| run | final eval loss | ratio to dp | merges | learner stall (max) | host copies "
        "(max) | wall s |",
        "|---|---|---|---|---|---|---|",
        f"| dp | {dp['final_eval_loss']:.4f} | 1.0000 | - | - | - | {dp['wall_s']:.0f} |",
        f"| diloco sgd 1.0/0.0 | {diloco['final_eval_loss']:.4f} | "
        f"{diloco['final_eval_loss'] / dp['final_eval_loss']:.4f} | {diloco['outer_syncs']} "
        f"| - | - | {diloco['wall_s']:.0f} |",
        *rows,
        "",
        *_spread(decoupled, dp["final_eval_loss"]),
        "Stall: wall time a learner's step loop spent waiting on the syncer (target ≤ 1%). "
        "Host copies: the loop's own device→host copies of due fragments and device puts of "
        "merged ones (not waiting on anything remote).",
        "",
        "† ran before two fixes: (1) the syncer's moving average of the sync time (ξ_sync in "
        "Eq. 3) counted every pull, also a learner catching up on a version merged without it, "
        "which inflated it to seconds and shut the grace window (`gather + share, τ=1 †`: "
        "ξ_sync 2.15 s, no round gathered); now only the return trip to learners whose push "
        "the merge holds counts, and a learner's pull waits for the merge that holds its push. "
        "(2) The host-copy timer also counted the wait for inner steps dispatched ahead of "
        "the device (`P=1 †`: 43.9%); the wait now happens before the timer starts. A round "
        "that gathers both pushes is merged the same way before and after (1).",
        "",
    ]
    seed_runs = _seeds(workroot, dp, diloco, decoupled)
    lines += seed_runs.pop("lines")
    slow_runs: list[dict] = []
    if not args.skip_slow:
        # Quorum 1 is the point of the comparison: the fast learner must not wait.
        best = SLOW_VARIANT
        overrides = dict(VARIANTS)[best]
        slow = {**SETTING, **SLOW, "train_steps": SLOW_STEPS}
        slow_diloco = run(
            f"slow3x_{SLOW_STEPS}_diloco_lr1.0-m0.0",
            {"mode": "diloco", **slow, "outer.lr": 1.0, "outer.momentum": 0.0},
            workroot,
        )
        slow_dec = run(
            f"slow3x_{SLOW_STEPS}_decoupled_"
            + best.replace(" ", "_").replace("/", "-").replace(",", ""),
            {"mode": "decoupled", **slow, **DECOUPLED, **overrides},
            workroot,
        )
        # After the fixes, with the settings `tiny_lm_decoupled.py` now defaults to.
        slow_gather = run(
            f"slow3x_{SLOW_STEPS}_decoupled_gather_share",
            {"mode": "decoupled", **slow, **GATHER, **SHARE},
            workroot,
        )
        slow_runs = [slow_diloco, slow_dec, slow_gather]
        target = dp["final_eval_loss"]
        lines += [
            f"### One learner 3x slower (decoupled: {best}, the best quorum-1 variant of the "
            "first sweep)",
            "",
            f"{SLOW_STEPS} steps per learner (twice the dp run's), so that the runs can reach "
            "dp's final loss. Seconds of training (process start-up excluded) until the global "
            "model's eval loss first reaches the target; evaluated every 50 steps. The row "
            "marked † ran before the fixes (see the first table's †); the last one after them, "
            "with gather + share (the defaults of `tiny_lm_decoupled.py`).",
            "",
            "| run | final eval loss | tokens | wall s | " + time_header(target) + " |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, s in (
            ("diloco", slow_diloco),
            (f"decoupled {best} †", slow_dec),
            ("decoupled gather + share", slow_gather),
        ):
            cells = time_cells(s, target)
            lines.append(
                f"| {name} | {s['final_eval_loss']:.4f} | {s['tokens']:,} | {s['wall_s']:.0f} "
                f"| {cells} |"
            )
        lines.append("")
    m4_diloco = run("m4_300_diloco_lr1.0-m0.0", {"mode": "diloco", **M4_SHORT, **SGD1}, workroot)
    m4_runs = {
        "decoupled sgd 1.0/0.0, τ=5, keep overlap": run(
            "m4_300_decoupled_sgd_1.0-0.0_tau5_keep_overlap",
            {"mode": "decoupled", **M4_SHORT, **DECOUPLED, **dict(VARIANTS)[KEEP5]},
            workroot,
        ),
        "decoupled gather (τ=10, γ=1, grace ≤ 10 s, keep overlap)": run(
            "m4_300_decoupled_gather", {"mode": "decoupled", **M4_SHORT, **GATHER}, workroot
        ),
        "decoupled share, learner anchor, τ=2, lr 1": run(
            "m4_300_decoupled_share_t2",
            {"mode": "decoupled", **M4_SHORT, **DECOUPLED, **SGD1, **SHARE},
            workroot,
        ),
        "decoupled gather + share, learner anchor": run(
            "m4_300_decoupled_gather_share",
            {"mode": "decoupled", **M4_SHORT, **GATHER, **SHARE},
            workroot,
        ),
    }
    lines += [
        "### M=4, H=50, 300 steps per learner: gathering the pushes of a round",
        "",
        "Quorum 1 closes a round at the first push plus the grace window (Eq. 3: γ·(τ·step − "
        "quorum − sync time)). With 4 learners sharing 2 cores their pushes of a round arrive "
        "seconds apart, so at τ=5 almost every merge holds one learner (merges ≈ pushes) and "
        "outer lr 1 then replaces the global fragment by that learner's. τ=10 with γ=1 and a "
        "10 s cap gathers them (merges ≈ rounds); the learners never wait, and keep_overlap keeps "
        "what they train meanwhile. All rows ran before the fixes (see the first table's †).",
        "",
        "| run | final eval loss | ratio to diloco | merges |",
        "|---|---|---|---|",
        f"| diloco sgd 1.0/0.0 | {m4_diloco['final_eval_loss']:.4f} | 1.0000 | "
        f"{m4_diloco.get('outer_syncs', '-')} |",
    ]
    for name, s in m4_runs.items():
        lines.append(
            f"| {name} | {s['final_eval_loss']:.4f} | "
            f"{s['final_eval_loss'] / m4_diloco['final_eval_loss']:.4f} | {s['outer_syncs']} |"
        )
    lines.append("")
    long_runs: list[dict] = []
    if not args.skip_long:
        long_dp = baseline("long:dp", "dp", (0.7, 0.9, True), workroot, LONG)
        long_diloco = baseline(
            "long:diloco lr1.0-m0.0", "diloco", (1.0, 0.0, False), workroot, LONG
        )
        long_dec = run(
            "long_decoupled_learner_anchor_sgd_0.25",
            {"mode": "decoupled", **LONG, **LONG_DECOUPLED},
            workroot,
        )
        long_gather = run(
            "long_decoupled_gather", {"mode": "decoupled", **LONG, **GATHER}, workroot
        )
        long_gather_share = run(
            "long_decoupled_gather_share",
            {"mode": "decoupled", **LONG, **GATHER, **SHARE},
            workroot,
        )
        long_repeat = run(  # the same command again: decoupled runs are not bit-repeatable
            "long_decoupled_gather_share_repeat",
            {"mode": "decoupled", **LONG, **GATHER, **SHARE},
            workroot,
        )
        # After the return-trip fix (commit "Syncer: ξ_sync counts only the return trip ..."):
        # the same command, twice.
        long_fixed = [
            run(
                f"long_decoupled_gather_share_fix{suffix}",
                {"mode": "decoupled", **LONG, **GATHER, **SHARE},
                workroot,
            )
            for suffix in ("", "_repeat")
        ]
        long_runs = [
            long_dp,
            long_diloco,
            long_dec,
            long_gather,
            long_gather_share,
            long_repeat,
            *long_fixed,
        ]
        lines += [
            "### M=4, H=50, 2,000 steps per learner (16.4M tokens per run)",
            "",
            "Decoupled: quorum 1, P=4, RDA; the first row τ=2 with the learner anchor and outer "
            "SGD lr 0.25 (1/M), the others the gathering settings of the M=4/300-step table. "
            "Rows marked † ran before the return-trip fix: the syncer's moving average of the "
            "sync time (ξ_sync in Eq. 3) counted every pull, also a learner catching up on a "
            "version merged without it seconds earlier, so it grew to 3-9 s, the grace window "
            "shrank to nothing, and most merges held one learner (merge sizes 311 ones of 424 "
            "merges, and 491 of 556). The fix counts only the return trip to the learners whose "
            "push the merge holds, and a learner's pull waits for the merge that holds its push. "
            "Target (issue 3): decoupled ≤ 1.01 × diloco.",
            "",
            "| run | final eval loss | ratio to dp | ratio to diloco | merges | merge sizes "
            "(1, 2, 3, 4 learners) | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in (
            ("dp", long_dp),
            ("diloco sgd 1.0/0.0", long_diloco),
            ("decoupled (τ=2, learner anchor, lr 0.25)", long_dec),
            ("decoupled gather (τ=10, γ=1, grace ≤ 10 s, keep overlap, lr 1)", long_gather),
            ("decoupled gather + share, learner anchor †", long_gather_share),
            ("decoupled gather + share, learner anchor † (the same command again)", long_repeat),
            ("decoupled gather + share, learner anchor", long_fixed[0]),
            ("decoupled gather + share, learner anchor (the same command again)", long_fixed[1]),
        ):
            lines.append(
                f"| {name} | {s['final_eval_loss']:.4f} | "
                f"{s['final_eval_loss'] / long_dp['final_eval_loss']:.4f} | "
                f"{s['final_eval_loss'] / long_diloco['final_eval_loss']:.4f} | "
                f"{s.get('outer_syncs', '-')} | {_sizes(s)} | {s['wall_s']:.0f} |"
            )
        lines.append("")
    lines += ["Commands of each run:", ""]
    for s in (
        dp,
        diloco,
        *decoupled.values(),
        *seed_runs["runs"],
        *slow_runs,
        m4_diloco,
        *m4_runs.values(),
        *long_runs,
    ):
        lines.append(f"- `{s['command']}`")
    _claims(section, dp, decoupled, slow_runs, long_runs)
    section.write(args.out, "\n".join(lines) + "\n")


def _claims(
    section: Section, dp: dict, decoupled: dict[str, dict], slow: list[dict], long: list[dict]
) -> None:
    """Decoupled against dp at M=2 and M=4, the learners' stall, and the 3x-slower learner."""
    ratios = _repeat_ratios(decoupled, dp["final_eval_loss"])
    if ratios:
        mean = statistics.mean(ratios)
        section.claim(
            "decoupled gather+share / dp final eval loss, M=2",
            round(mean, 4),
            unit="×",
            goal="≤ 1.08",
            met=mean <= 1.08,
            headline=True,
            note=f"mean of {len(ratios)} runs of the gather + share command",
            section="Decoupled mode: quality, learner stall, heterogeneity (issue 3)",
        )
    stall = max(x["stall_fraction"] for s in decoupled.values() for x in s["learners"])
    section.claim(
        "learner stall, max over the M=2 decoupled runs",
        round(100 * stall, 3),
        unit="%",
        goal="≤ 1%",
        met=stall <= 0.01,
        headline=True,
        section="Decoupled mode: quality, learner stall, heterogeneity (issue 3)",
    )
    if long:
        long_dp, long_diloco, *_, fixed, again = long
        ratio = statistics.mean(s["final_eval_loss"] for s in (fixed, again))
        ratio /= long_diloco["final_eval_loss"]
        section.claim(
            "decoupled / diloco final eval loss, M=4, 2,000 steps",
            round(ratio, 4),
            unit="×",
            goal="≤ 1.01",
            met=ratio <= 1.01,
            headline=True,
            note="mean of the two gather + share runs after the return-trip fix",
            section="M=4, H=50, 2,000 steps per learner (16.4M tokens per run)",
        )
    if slow:
        slow_diloco, _, slow_gather = slow
        t_dec = time_to(slow_gather, dp["final_eval_loss"])
        t_diloco = time_to(slow_diloco, dp["final_eval_loss"])
        section.claim(
            "one learner 3x slower: s to dp's loss, gather + share",
            "not reached" if t_dec is None else round(t_dec),
            unit="s",
            baseline=f"diloco {'not reached' if t_diloco is None else round(t_diloco)}",
            goal="sooner than diloco",
            met=t_dec is not None and (t_diloco is None or t_dec < t_diloco),
            section="One learner 3x slower",
        )


if __name__ == "__main__":
    main()
