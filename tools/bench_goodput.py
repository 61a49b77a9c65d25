"""Benchmark: the goodput simulator against the paper's table, its speed, and a go-beyond policy.

Run alone with `python -m tools.bench_goodput --out=benchmarks/results/goodput.md`, or through
`make bench`. Writes one Markdown section: the reproduction table (measured vs paper, mean and
spread over seeds), the time of a 2.4M-chip full 1T-token simulation of all three systems, and
the go-beyond policy at 2.4M chips, M=8.
"""

import argparse
import dataclasses
import statistics
import time

from decoupled_diloco.sim import SimConfig, simulate
from tools.benchkit import Section

# (chips, system, M, paper goodput) from the paper's table (literature.md section 1).
PAPER = [
    (1_200_000, "dp", 1, 0.27),
    (1_200_000, "elastic_dp", 1, 0.58),
    (1_200_000, "decoupled", 2, 0.70),  # "~70%", not part of issue 6's required targets
    (1_200_000, "decoupled", 8, 0.88),
    (1_200_000, "decoupled", 16, 0.93),
    (2_400_000, "dp", 1, 0.18),
    (2_400_000, "elastic_dp", 1, 0.40),
    (2_400_000, "decoupled", 8, 0.80),
    (2_400_000, "decoupled", 16, 0.86),
]
UPTIME_CHECKS = [(n, m) for n in (1_200_000, 2_400_000) for m in (4, 8, 16)]
SEEDS = (0, 1, 2, 3, 4)
TOLERANCE = 0.05


def _run(cfg: SimConfig, system: str) -> tuple[float, float]:
    res = simulate(cfg, (system,))[system]
    return res.goodput, res.uptime


def _over_seeds(cfg: SimConfig, system: str) -> tuple[float, float, float]:
    """Mean goodput, its spread (max - min) and the minimum uptime over SEEDS."""
    runs = [_run(dataclasses.replace(cfg, seed=s), system) for s in SEEDS]
    goodputs = [g for g, _ in runs]
    return statistics.mean(goodputs), max(goodputs) - min(goodputs), min(u for _, u in runs)


def _reproduction(base: SimConfig, section: Section) -> list[str]:
    lines = [
        "| chips | system | M | paper | measured (mean of 5 seeds) | spread | diff | within ±5 |",
        "|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    within: list[bool] = []
    for chips, system, m, target in PAPER:
        cfg = dataclasses.replace(base, num_chips=chips, num_learners=m)
        mean, spread, _ = _over_seeds(cfg, system)
        diff = mean - target
        ok = "yes" if abs(diff) <= TOLERANCE else "**no**"
        within.append(abs(diff) <= TOLERANCE)
        if (chips, system, m) == (2_400_000, "decoupled", 8):
            section.claim(
                "simulated decoupled goodput, 2.4M chips, M=8",
                round(100 * mean, 1),
                unit="%",
                baseline=f"paper {100 * target:.0f}%",
                goal="within ±5",
                met=abs(diff) <= TOLERANCE,
                headline=True,
                section="Reproduction of the paper's goodput table",
                note=f"mean of {len(SEEDS)} seeds",
            )
        lines.append(
            f"| {chips / 1e6:.1f}M | {system} | {m if system == 'decoupled' else '–'} "
            f"| {100 * target:.0f}% | {100 * mean:.1f}% | {100 * spread:.1f} "
            f"| {100 * diff:+.1f} | {ok} |"
        )
    section.claim(
        "rows of the paper's goodput table reproduced within ±5 points",
        f"{sum(within)} of {len(within)}",
        goal="all",
        met=all(within),
        section="Reproduction of the paper's goodput table",
    )
    lines += [
        "",
        "| chips | M | paper uptime | measured uptime (min over 5 seeds) |",
        "|---:|---:|---:|---:|",
    ]
    for chips, m in UPTIME_CHECKS:
        cfg = dataclasses.replace(base, num_chips=chips, num_learners=m)
        _, _, uptime = _over_seeds(cfg, "decoupled")
        lines.append(f"| {chips / 1e6:.1f}M | {m} | 100% | {100 * uptime:.3f}% |")
    return lines


def _timing(base: SimConfig, section: Section) -> list[str]:
    cfg = dataclasses.replace(base, num_chips=2_400_000, num_learners=8)
    walls, cpus = [], []
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        res = simulate(cfg)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    events = sum(r.interruptions for r in res.values())
    section.claim(
        "simulator wall time, 2.4M chips, 1T tokens, 3 systems",
        round(min(walls), 2),
        unit="s",
        goal="≤ 30 s on one core",
        met=min(walls) <= 30,
        section="Speed",
        note="best of 3",
    )
    return [
        f"2.4M chips, 1T tokens, all three systems (M=8), one process: "
        f"**{min(walls):.2f} s** wall (best of 3; median {statistics.median(walls):.2f} s; "
        f"CPU {min(cpus):.2f} s). Target ≤ 30 s on one core. "
        f"{events} interruptions handled in total; simulated wall-clock: "
        + ", ".join(f"{k} {r.wall_s / 3600:.0f} h" for k, r in res.items())
        + "."
    ]


def _go_beyond(base: SimConfig) -> list[str]:
    cfg = dataclasses.replace(base, num_chips=2_400_000, num_learners=8)
    variants = [
        ("paper's decoupled (baseline)", {}),
        ("+ salvage on failure", {"salvage_on_failure": True}),
        ("+ background upscale (1 s switch)", {"background_upscale": True}),
        ("+ both (1 s switch)", {"salvage_on_failure": True, "background_upscale": True}),
        (
            "+ both, pessimistic 4 s switch",
            {"salvage_on_failure": True, "background_upscale": True, "upscale_switch_s": 4.0},
        ),
    ]
    lines = [
        "| policy (2.4M chips, M=8) | goodput (mean of 5 seeds) | vs paper 80% | vs our baseline |",
        "|---|---:|---:|---:|",
    ]
    baseline = None
    for name, overrides in variants:
        mean, _, _ = _over_seeds(dataclasses.replace(cfg, **overrides), "decoupled")
        baseline = mean if baseline is None else baseline
        lines.append(
            f"| {name} | {100 * mean:.1f}% | {100 * (mean - 0.80):+.1f} "
            f"| {100 * (mean - baseline):+.1f} |"
        )
    elastic, _, _ = _over_seeds(cfg, "elastic_dp")
    elastic_bg, _, _ = _over_seeds(dataclasses.replace(cfg, background_upscale=True), "elastic_dp")
    lines += [
        "",
        f"For fairness: background upscale also helps elastic DP at 2.4M chips, from "
        f"{100 * elastic:.1f}% to {100 * elastic_bg:.1f}%; salvage has no elastic-DP counterpart "
        "(one synchronous job has no rounds to miss).",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="Markdown file to write")
    args = parser.parse_args(argv)
    base = SimConfig()
    t0 = time.perf_counter()
    section = Section("goodput", argv)
    sections = ["## Goodput simulator (issue 6)", ""]
    sections += [
        f"{section.header()} "
        "Paper setting: dense 5B, 1T tokens, MTBI 1 year per chip; one parameter set for every "
        "row (the `SimConfig` defaults, see docs/simulator.md): "
        f"slice {base.slice_chips} chips, slice return {base.slice_return_s:.0f} s, "
        f"step {base.step_s:.0f} s, {base.tokens_per_step / 2**20:.0f}M tokens/step, "
        f"DP checkpoint {base.checkpoint_s} s at Daly's interval, "
        f"DP restart {base.restart_s:.0f} s, "
        f"downscale {base.downscale_s:.0f} s, upscale {base.upscale_s:.0f} s, "
        f"H = {base.sync_every_steps}, K = {base.quorum}.",
        "",
        "### Reproduction of the paper's goodput table",
        "",
    ]
    sections += _reproduction(base, section)
    sections += ["", "### Speed", ""] + _timing(base, section)
    sections += ["", "### Go beyond: salvage + background upscale", ""] + _go_beyond(base)
    sections += ["", f"(Whole benchmark: {time.perf_counter() - t0:.0f} s.)", ""]
    section.write(args.out, "\n".join(sections))


if __name__ == "__main__":
    main()
