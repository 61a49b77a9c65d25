r"""`python -m tools.bench_wan --out=benchmarks/results/wan.md [--quick]`: training over WAN links.

Every limited run puts each site (a learner, or for `dp` each process of its island) in its own
network namespace behind a kernel rate limit (`decoupled.wan_mbit`, `decoupled_diloco.local.wan`;
the in-process pacer where the kernel cannot shape, and the table says which). The limits are the
paper's 12B run over 5, 2, 1 and 0.5 Gbit/s scaled to this model by the ratio of communication
to computation (`sim.bandwidth.scaled_bandwidth`, with `PAPER_12B`'s assumptions); this model's
step time is measured by the first, unlimited run. The settings, M learners (sites) each:

- `decoupled <scheme> P=<P>`: decoupled DiLoCo as configured (τ = H/5, merges applied on
  arrival); int8 and e3m0 compress both ways (`compression.downlink`), none sends float32.
- `diloco`: synchronous DiLoCo across the syncer: one fragment, quorum M, τ 0, and every
  learner waits at each sync for the merge of all M (`decoupled.wait_for_merge`); float32
  outer gradients up and merged values down, one after the other.
- `dp`: one island data-parallel over M processes, one per site: its gradient all-reduce (XLA's
  gloo collectives on CPU) crosses the links every step (`decoupled.wan_sites="process"`; outer
  SGD at lr 1 without momentum, one sync at the end: exactly data-parallel training; the
  limited dp runs, timed only, send that sync as e3m0 to spare the slow link).

Utilisation: for decoupled and diloco, stepping time (less the link's waits inside the step
loop, `blocked_s`) over the learners' time from their first step on (stepping, blocked,
checkpointing), from the timelines; "without final flush" leaves out the waits after the last
step, which a long run amortises. The planner (`sim.bandwidth.utilisation`) predicts both: for
the run's length, final flush included (its end played out push by push, `sim.link_end`), and
for a long run. A decoupled learner never waits for
its link (its mode `decoupled` says 1 for a long run); a slow link shows instead as a longer
interval between a fragment's syncs (`sim.bandwidth.sync_interval_steps`, "planned interval")
and, measured, as pushes the syncer refused as too stale ("late") and last pushes still unsent
when the flush's bound ran out ("unsent"). For
dp the wait is inside XLA's step, so utilisation is the unlimited run's step time over the
limited one's. A dp step behind a scaled link takes minutes, so limited dp runs time a few steps
(`_dp_steps`); their loss is the unlimited run's (dp's math does not depend on the link). "Link
load" is the busiest site's busier direction, in bytes the kernel counted, over the run's wall
time.

Before `decoupled.wait_for_merge` (2026-12-05) diloco could not be measured: a setting of
fragments 1, quorum M, τ 0 without waits let the learners step on while the merges crossed the
links, and the runs diverged (eval loss 1.41× and 4.15× the unlimited run at the scaled 5 and
2 Gbit/s). Its waits are the link's `blocked_s`, so they count against its utilisation; the
planner's `diloco` mode (topology `syncer`: push, merge, pull in turn) predicts it.

`--quick`: only decoupled e3m0 P=4 and dp, unlimited and at the scaled 2 Gbit/s (dp's unlimited
run times 20 steps, its limited run ~1 minute of steps); it ends with `scaled 2 Gbit/s:
decoupled utilisation U, dp utilisation V, shaping tbf|pacer`. Runs are reused when their
workdir holds the very same config (`local.runs`), so a sweep can be extended with `--settings`
and `--gbps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import signal
import subprocess
import sys
import time

from decoupled_diloco import config as c
from decoupled_diloco.local import runs, wan
from decoupled_diloco.sim import bandwidth
from tools.benchkit import ROOT, Section

CONFIG = "experiments/configs/tiny_lm_decoupled.py"
SCALED_GBPS = (5.0, 2.0, 1.0, 0.5)
QUICK_DP_STEPS = 20
DP_TIMED_S = 120.0  # see `_dp_steps`; --quick: QUICK_DP_TIMED_S
QUICK_DP_TIMED_S = 60.0
LONG_STEP_S = 150.0  # see `_dp_steps`
# Chunks that cross the slowest link here (0.5 Gbit/s scaled: ~0.16 Mbit/s) in ~3 s, well
# within the streams' idle cut (`config.checks`: half of min(stream_idle_s, rpc_timeout_s)).
CHUNK_BYTES = 64 << 10
_FIRST_STEP_ON = ("stepping", "blocked", "checkpointing", "paused")
# Bits per value on the wire: the scheme's code plus its float32 scale per 256-value block.
_BITS = {"none": 32.0, "int8": 8.125, "e3m0": 4.125}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One line of the sweep: a mode, its overrides of `CONFIG`, and the planner's view of it."""

    name: str
    kind: str  # "decoupled", "diloco" or "dp"
    scheme: str = "none"
    fragments: int = 1

    def overrides(self, learners: int, steps: int, batch: int) -> dict[str, object]:
        """`--config.KEY=VALUE` for `learners` sites, `steps` steps, `batch` per site."""
        base: dict[str, object] = {"num_learners": learners, "train_steps": steps,
                                   "decoupled.syncer.chunk_bytes": CHUNK_BYTES}  # fmt: skip
        if self.kind == "decoupled":
            down = self.scheme != "none"
            return {**base, "compression.scheme": self.scheme, "compression.downlink": down,
                    "decoupled.fragments": self.fragments}  # fmt: skip
        if self.kind == "diloco":  # synchronous: every learner waits for each round's merge
            return {**base, "decoupled.fragments": 1, "decoupled.quorum": learners,
                    "decoupled.overlap_steps": 0, "decoupled.apply_on_arrival": True,
                    "decoupled.wait_for_merge": True}  # fmt: skip
        return {  # dp: one island over `learners` sites, the same total batch
            **base, "num_learners": 1, "inner_steps": steps, "decoupled.fragments": 1,
            "decoupled.island_processes": learners, "decoupled.wan_sites": "process",
            "mesh.shape": (learners, 1), "data.batch_size": batch * learners,
            "outer.lr": 1.0, "outer.momentum": 0.0, "outer.nesterov": False,
            "outer.merge": "mean",
        }  # fmt: skip

    def planned(
        self, w: bandwidth.Workload, learners: int, gbps: float, run_steps: int = 0
    ) -> float:
        """The planner's utilisation (`sim.bandwidth.utilisation`) for this setting.

        `run_steps`: the run's length, whose final flush then counts (0: a long run).
        """
        if gbps <= 0:
            return 1.0
        common = {"params": w.params, "step_time_s": w.step_time_s, "num_learners": learners,
                  "run_steps": run_steps}  # fmt: skip
        if self.kind == "dp":
            common["run_steps"] = 0  # (dp's utilisation is its steps' only)
            plan = bandwidth.LinkPlan(**common, inner_steps=1, fragments=1, overlap_steps=0,
                                      dp_bits=32, topology="allreduce")  # fmt: skip
            return bandwidth.utilisation(plan, "dp", gbps)
        if self.kind == "diloco":  # the push, the merge, then the pull, every H steps
            plan = bandwidth.LinkPlan(**common, inner_steps=w.inner_steps, fragments=1,
                                      overlap_steps=0, dp_bits=32, topology="syncer")  # fmt: skip
            return bandwidth.utilisation(plan, "diloco", gbps)
        return bandwidth.utilisation(self.decoupled_plan(w, common), "decoupled", gbps)

    def sync_interval(self, w: bandwidth.Workload, learners: int, gbps: float) -> float:
        """The planner's steps between a fragment's syncs (decoupled; NaN otherwise)."""
        if self.kind != "decoupled" or gbps <= 0:
            return float("nan")
        common = {"params": w.params, "step_time_s": w.step_time_s, "num_learners": learners}
        return bandwidth.sync_interval_steps(self.decoupled_plan(w, common), gbps)

    def decoupled_plan(self, w: bandwidth.Workload, common: dict) -> bandwidth.LinkPlan:
        """The planner's inputs for this decoupled setting, `common` (N, step time, ...) given."""
        bits = _BITS[self.scheme]
        return bandwidth.LinkPlan(
            **common, inner_steps=w.inner_steps, fragments=self.fragments,
            overlap_steps=w.inner_steps // 5, bits=bits, down_bits=bits, topology="syncer",
            **_end(),
        )  # fmt: skip


@functools.cache
def _end() -> dict[str, object]:
    """How the runs' learners end (`LinkPlan`'s `data_leases`, `flush_timeout_s`, `trip_wait_s`).

    On data leases a learner's end is the pause at its last lease, which waits until every
    push is answered; without leases the final flush gives up after 2 x rpc_timeout_s
    (`learner.push.flush`). Either waits up to rpc_timeout_s for a round trip under way.
    """
    run = runs.resolve(CONFIG)
    timeout = run.decoupled.syncer.rpc_timeout_s
    return {"data_leases": c.data_leases(run), "flush_timeout_s": 2 * timeout,
            "trip_wait_s": timeout}  # fmt: skip


SETTINGS = [
    *(
        Setting(f"decoupled {s} P={p}", "decoupled", s, p)
        for s in ("e3m0", "int8", "none")
        for p in (4, 1)
    ),  # fmt: skip
    Setting("diloco", "diloco"),
    Setting("dp", "dp"),
]
QUICK = ("decoupled e3m0 P=4", "dp")


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


def step_time(summary: dict, net_of_waits: bool = True) -> float:
    """Seconds per inner step, from the timelines: stepping time less the link's waits.

    Over the steps after the first, which compiles (`compiling` in the timeline). A dp island
    spanning sites (`net_of_waits=False`) waits inside its steps for collectives (the gradient
    all-reduce, and the leader's per-step broadcast that `blocked_s` counts), so all of its
    stepping time is its step time.
    """
    stepping = sum(
        x["by_state"].get("stepping", 0.0) for x in summary["timeline"]["learners"].values()
    )
    blocked = sum(x.get("blocked_s", 0.0) for x in summary["learners"]) if net_of_waits else 0.0
    steps = sum(max(x["steps"] - 1, 1) for x in summary["learners"])
    return (stepping - blocked) / steps


def link_load_mbit(summary: dict) -> float:
    """The busiest site's busier direction over the run's wall time (Mbit/s); 0 unshaped."""
    sites = summary.get("wan", {}).get("sites", [])
    busiest = max((max(s["up_bytes"], s["down_bytes"]) for s in sites), default=0)
    return busiest * 8 / 1e6 / max(summary["wall_s"], 1e-9)


def _workload(ref: bandwidth.Workload, setting: Setting, free: dict) -> bandwidth.Workload:
    """What the planner predicts `setting` from: its own unlimited run's step time (and H)."""
    if setting.kind == "dp":
        return dataclasses.replace(ref, step_time_s=step_time(free, net_of_waits=False))
    return dataclasses.replace(ref, step_time_s=step_time(free), inner_steps=free["inner_steps"])


def _dp_steps(
    setting: Setting, w: bandwidth.Workload, learners: int, gbps: float, timed_s: float
) -> tuple[int, dict[str, object]]:
    """Steps of a limited dp run, and its overrides beyond the setting's.

    The steps: the compiling one plus `timed_s` of planned steps (at least one, at most 10).
    `--quick` times ~1 minute (one step at the scaled 2 Gbit/s: three took 321 s, which put the
    run at 604 s, over its 10 minutes); a sweep ~2 minutes.

    Where a planned step is over `LONG_STEP_S`, the island's heartbeat timeout is three planned
    steps: at the scaled 0.5 Gbit/s the all-reduce starved JAX's coordination heartbeats past
    the default 10 s, and the island was stopped and restarted at every step (a crash loop).
    """
    per_step = w.step_time_s / setting.planned(w, learners, gbps)
    extra = (
        {"decoupled.island_heartbeat_s": math.ceil(3 * per_step)} if per_step > LONG_STEP_S else {}
    )
    return 1 + max(1, min(10, math.floor(timed_s / per_step))), extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wan.md"))
    parser.add_argument("--quick", action="store_true", help="the scaled 2 Gbit/s only")
    parser.add_argument("--settings", default="", help="comma-separated names (default: all)")
    parser.add_argument("--workdir", default="runs/bench_wan")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--gbps", default="", help="comma-separated scaled rates (default: 5,2,1,0.5; --quick: 2)"
    )
    args = parser.parse_args(argv)
    # A stopped benchmark stops its running cell too (`runs.run_or_reuse`), whose launcher
    # removes the namespaces it made.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    given = sys.argv[1:] if argv is None else argv
    shown = " ".join(["python -m tools.bench_wan", *given])  # as run, to run it again
    chosen = [x for x in args.settings.split(",") if x] or (QUICK if args.quick else [])
    known = {s.name: s for s in SETTINGS}
    if set(chosen) - set(known):
        sys.exit(f"unknown settings in {chosen}; known: {list(known)}")
    settings = [known[name] for name in chosen] if chosen else SETTINGS  # (in the order given)
    ok, why = wan.available()
    shaping = "tbf" if ok else f"pacer ({why})"
    root, batch = pathlib.Path(args.workdir), runs.resolve(CONFIG).data.batch_size
    gbps_list = (
        tuple(float(x) for x in args.gbps.split(","))
        if args.gbps
        else (2.0,)
        if args.quick
        else SCALED_GBPS
    )
    dp_timed_s = QUICK_DP_TIMED_S if args.quick else DP_TIMED_S
    t0 = time.time()
    counts = {"run": 0, "reused": 0}  # (the reference run counts again as its setting's row)
    failures: dict[tuple[str, float], str] = {}  # (setting, gbps) -> the run's last error line

    def cell_dir(setting: Setting, tag: str) -> pathlib.Path:
        return root / setting.name.replace(" ", "_").replace("=", "") / tag

    def run(setting: Setting, tag: str, steps: int, mbit: float = 0.0, **extra: object) -> dict:
        overrides = {**setting.overrides(args.learners, steps, batch), **extra}
        if mbit:
            overrides["decoupled.wan_mbit"] = round(mbit, 4)
        if setting.kind == "dp" and mbit:  # (the one sync at the end: 8x fewer bytes)
            overrides["compression.scheme"] = "e3m0"
        workdir = cell_dir(setting, tag)
        counts["reused" if runs.finished(workdir, runs.resolve(CONFIG, overrides)) else "run"] += 1
        return runs.run_or_reuse(CONFIG, overrides, workdir, tag="bench_wan")

    # The links' rates come from this model's own decoupled run (unlimited): its N, H, step time.
    ref = run(SETTINGS[0], "unlimited", args.steps)
    workload = bandwidth.Workload(ref["params"], ref["inner_steps"], step_time(ref))
    # (setting, link, gbps, mbit, summary, utilisation, without flush, planned, long-run planned)
    rows = []
    for setting in settings:
        free_steps = QUICK_DP_STEPS if args.quick and setting.kind == "dp" else args.steps
        free = run(setting, "unlimited", free_steps)
        w = _workload(workload, setting, free)
        # (dp's utilisation is relative to its own unlimited run: 1 there by definition)
        u_free = (1.0, 1.0) if setting.kind == "dp" else utilisation(free)
        interval = setting.sync_interval(w, args.learners, 0.0)
        rows.append((setting, "unlimited", 0.0, 0.0, free, *u_free, 1.0, 1.0, interval))
        for gbps in gbps_list:
            mbit = bandwidth.scaled_bandwidth(gbps * 1e9, bandwidth.PAPER_12B, workload) / 1e6
            steps, extra = (
                _dp_steps(setting, w, args.learners, mbit / 1e3, dp_timed_s)
                if setting.kind == "dp"
                else (args.steps, {})
            )
            try:
                s = run(setting, f"{gbps:g}gbps", steps, mbit, **extra)
            except subprocess.CalledProcessError:  # a failed cell is a result too
                s, u = None, math.nan
                log = cell_dir(setting, f"{gbps:g}gbps") / "train.log"
                failures[(setting.name, gbps)] = _last_error(log)
                print(f"[bench_wan] {setting.name} at scaled {gbps:g} Gbit/s failed", flush=True)
            else:
                if setting.kind == "dp":
                    u = w.step_time_s / step_time(s, net_of_waits=False)
                    u_noflush = u
                else:
                    u, u_noflush = utilisation(s)
            planned = setting.planned(w, args.learners, mbit / 1e3, steps)
            long_run = setting.planned(w, args.learners, mbit / 1e3)
            interval = setting.sync_interval(w, args.learners, mbit / 1e3)
            link = f"scaled {gbps:g} Gbit/s"
            rows.append((setting, link, gbps, mbit, s, u, u_noflush, planned, long_run, interval))

    text = _table(rows, shown, time.time() - t0, args, workload, shaping, counts, failures)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot(rows, args.learners, workload, out.with_suffix(".png"))
    section = Section("wan", given)
    two = {r[0].name: r[5] for r in rows if r[2] == 2.0}
    for name, u in two.items():
        section.claim(
            f"{name} utilisation, scaled 2 Gbit/s, {args.steps} steps",
            round(u, 3),
            goal="0.95" if name.startswith("decoupled") else "",
            met=u >= 0.95 if name.startswith("decoupled") else None,
            headline=name == "decoupled e3m0 P=4",
            note=f"shaping {shaping}",
            section="WAN: training behind kernel rate limits",
        )
    section.write(out, text + f"\n![utilisation vs bandwidth]({out.with_suffix('.png').name})\n")
    if {"decoupled e3m0 P=4", "dp"} <= set(two):
        print(
            f"scaled 2 Gbit/s: decoupled utilisation {two['decoupled e3m0 P=4']:.3f}, "
            f"dp utilisation {two['dp']:.3f}, shaping {'tbf' if ok else 'pacer'}"
        )
    return 1 if failures else 0


def _last_error(log: pathlib.Path) -> str:
    """The exception that ended a failed run, from its log (else the log's last line)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    raised = [x for x in lines if x and not x[0].isspace() and "Error: " in x]
    return (raised or lines or ["no log"])[-1].strip()[:300]


def _table(rows, shown, seconds, args, workload, shaping, counts, failures) -> str:
    lines = [
        "## WAN: training behind kernel rate limits\n",
        f"`{shown}` ({time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s; {counts['run']} runs "
        f"made, {counts['reused']} reused from earlier invocations, `local.runs`): {CONFIG}, "
        f"{args.learners} sites, {args.steps} steps (equal tokens; limited dp runs time fewer, "
        f"see below); {workload.params / 1e6:.2f}M parameters; step time "
        f"{workload.step_time_s * 1e3:.0f} ms, H = {workload.inner_steps} (the first unlimited "
        f"run); shaping: {shaping}. The paper's side (`sim.bandwidth.PAPER_12B`): 12e9 "
        "parameters, H = 100 (Table 4's; assumed), 1 s steps (assumed, between Table 4's 10B "
        "and 100B). Each row's command is in its workdir's `summary.json` (`command`).\n",
        "| setting | link | rate here (Mbit/s) | utilisation | planned | Δ (points) "
        "| without final flush | planned, long run | Δ (points) | planned interval (steps) "
        "| late / unsent | steps / budget | stall max | goodput "
        "| wall (s) | final eval loss | vs unlimited | MB sent | link load (Mbit/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for setting, link, gbps, mbit, s, u, u_noflush, planned, long_run, interval in rows:
        if s is None:
            why = failures[(setting.name, gbps)].replace("|", "/")
            lines.append(
                f"| {setting.name} | {link} | {mbit:.3f} | **failed**: {why} | {planned:.3f} "
                f"|{' — |' * 14}"
            )
            continue
        loss = s["final_eval_loss"]
        if link == "unlimited":
            base[setting.name] = loss
        timed = setting.kind == "dp" and link != "unlimited"
        loss_cell = f"= unlimited ({s['train_steps']} steps timed)" if timed else f"{loss:.4f}"
        ratio = "—" if timed else f"{loss / base[setting.name]:.4f}"
        lines.append(
            f"| {setting.name} | {link} | {mbit:.3f} | {u:.3f} | {planned:.3f} "
            f"| {100 * (planned - u):+.1f} | {u_noflush:.3f} | {long_run:.3f} "
            f"| {100 * (long_run - u_noflush):+.1f} | {_cell(interval)} "
            f"| {sum(x['pushes']['late'] for x in s['learners'])} / "
            f"{sum(x['pushes_unsent'] for x in s['learners'])} "
            f"| {_steps_over_budget(s, args.learners, args.steps)} "
            f"| {s['stall_fraction_max']:.4f} | "
            f"{s.get('goodput', float('nan')):.3f} | {s['wall_s']:.0f} | {loss_cell} | {ratio} | "
            f"{s['bytes_sent'] / 1e6:.1f} | {link_load_mbit(s):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _steps_over_budget(summary: dict, learners: int, steps: int) -> str:
    """Inner steps the learners trained over the budget's (> 1: data trained again)."""
    done = sum(x.get("steps", 0) for x in summary["learners"])
    return f"{done / (learners * steps):.2f}"


def _cell(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f}"


def _plot(rows, learners: int, workload, path: pathlib.Path) -> None:
    """Utilisation vs the paper-side bandwidth: the planner's curve and the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    grid = [0.3 * 1.05**i for i in range(60)]
    names = list(dict.fromkeys(r[0].name for r in rows))
    for i, name in enumerate(names):
        setting = next(r[0] for r in rows if r[0].name == name)
        w = _workload(workload, setting, next(r[4] for r in rows if r[0] is setting))
        scale = bandwidth.scaled_bandwidth(1e9, bandwidth.PAPER_12B, workload) / 1e9
        color = f"C{i}"
        steps = next(r[4]["train_steps"] for r in rows if r[0] is setting)
        ax.plot(grid, [setting.planned(w, learners, g * scale, steps) for g in grid],
                color=color, lw=1, alpha=0.7)  # fmt: skip
        points = [(r[2], r[5]) for r in rows if r[0].name == name and r[2] > 0 and r[4]]
        if points:
            ax.plot(*zip(*points, strict=True), "o", color=color, label=name)
    ax.set_xscale("log")
    ax.set_xticks(SCALED_GBPS, [f"{g:g}" for g in SCALED_GBPS])
    ax.minorticks_off()
    ax.set_xlabel("paper-side bandwidth (Gbit/s, scaled to this model)")
    ax.set_ylabel("compute utilisation")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title("measured (points) vs planned (lines)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
