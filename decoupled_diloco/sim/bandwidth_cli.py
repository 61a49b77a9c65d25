"""`python -m decoupled_diloco.sim bandwidth`: utilisation on a link, and the bandwidth needed.

Examples:
    python -m decoupled_diloco.sim bandwidth --params=1B --step_time_s=0.1  # H=100, P=8, 4 bit
    python -m decoupled_diloco.sim bandwidth --params=12B --step_time_s=1 \
        --bandwidth_gbps=2.5 --json
    python -m decoupled_diloco.sim bandwidth --paper_table  # beside Streaming DiLoCo, Table 4

The model and every assumption it makes: `decoupled_diloco.sim.bandwidth`.
"""

import argparse
import dataclasses
import json
import math
import sys

from decoupled_diloco.sim import bandwidth
from decoupled_diloco.sim.bandwidth import MODES, TARGETS, LinkPlan, paper_rows, parse_count, plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=bandwidth.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params", type=parse_count, default=1e9, help="model size, e.g. 1B")
    p.add_argument("--step_time_s", type=float, default=0.1, help="compute time of one inner step")
    p.add_argument(
        "--inner_steps", type=int, default=100, help="H: steps between syncs of a fragment"
    )
    p.add_argument("--fragments", type=int, default=8, help="P: fragments, staggered over H")
    p.add_argument("--overlap_steps", type=float, default=1.0, help="tau: steps a sync may overlap")
    p.add_argument("--bits", type=float, default=4.0, help="bits/param of the outer gradient")
    p.add_argument("--down_bits", type=float, default=0.0, help="syncer->learner bits (0: =bits)")
    p.add_argument("--dp_bits", type=float, default=16.0, help="bits/param for dp and diloco")
    p.add_argument("--num_learners", type=int, default=2, help="M")
    p.add_argument("--topology", choices=("syncer", "allreduce"), default="syncer")
    p.add_argument("--latency_s", type=float, default=0.0, help="one-way latency per transfer")
    p.add_argument("--backward_fraction", type=float, default=2 / 3, help="step share hiding comms")
    p.add_argument("--bandwidth_gbps", type=float, default=0.0, help="link; 0: only the needs")
    p.add_argument(
        "--targets",
        type=lambda s: tuple(float(x) for x in s.split(",") if x),
        default=TARGETS,
        help="comma-separated utilisation targets",
    )
    p.add_argument(
        "--run_steps", type=int, default=0, help="T: count the final flush of a T-step run"
    )
    p.add_argument(
        "--data_leases",
        action=argparse.BooleanOptionalAction,
        default=LinkPlan.data_leases,
        help="decoupled: the end is the pause at the last lease (the default), or the flush",
    )
    p.add_argument(
        "--flush_timeout_s",
        type=float,
        default=LinkPlan.flush_timeout_s,
        help="decoupled, --no-data_leases: the final flush's bound (0: none)",
    )
    p.add_argument(
        "--trip_wait_s",
        type=float,
        default=LinkPlan.trip_wait_s,
        help="decoupled: the end's wait for a round trip under way (rpc_timeout_s)",
    )
    p.add_argument(
        "--crossing_efficiency",
        type=float,
        default=LinkPlan.crossing_efficiency,
        help="decoupled: share of the rate a push gets while a merge comes down",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--paper_table", action="store_true", help="compare with Streaming DiLoCo")
    return p


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def link_plan(args: argparse.Namespace) -> LinkPlan:
    """The parsed flags as the model's inputs."""
    return LinkPlan(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(LinkPlan)},
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: prints the plan (or `--json`, `--paper_table`); its exit code."""
    parsed = _parser().parse_args(argv)
    args = link_plan(parsed)
    if parsed.paper_table:
        rows = paper_rows()
        if parsed.json:
            print(json.dumps(rows, indent=2))
            return 0
        print("Gbit/s for " + " / ".join(f"{round(100 * q)}%" for q in TARGETS) + " utilisation")
        for r in rows:
            label = f"{r['params'] / 1e9:g}B ({r['step_time_s']} s) {r['mode']:9s}"
            print(f"{label} ours  " + " / ".join(_fmt(x) for x in r["ours"]))
            print(f"{'':{len(label)}} paper " + " / ".join(_fmt(x) for x in r["paper"]))
        return 0
    try:
        out = plan(args)
    except ValueError as e:
        print(f"plan_bandwidth: {e}", file=sys.stderr)
        return 2
    if parsed.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(
        f"{args.params / 1e9:g}B params, {args.step_time_s} s/step, H={args.inner_steps}, "
        f"P={args.fragments}, tau={args.overlap_steps}, {args.bits:g} bit, M={args.num_learners}, "
        f"{args.topology}"
    )
    head = " ".join(f"{round(100 * q):>6d}%" for q in args.targets)
    util = "  utilisation" if args.bandwidth_gbps else ""
    print(f"{'mode':10s} {head}  (Gbit/s needed){util}")
    for mode in MODES:
        row = out[mode]
        cells = " ".join(f"{_fmt(v):>7s}" for k, v in row.items() if k.startswith("gbps_for"))
        extra = f"  {100 * row['utilisation']:.1f}%" if "utilisation" in row else ""
        print(f"{mode:10s} {cells}{extra}")
    d = out["decoupled"]
    at = f"; at {args.bandwidth_gbps:g} Gbit/s every {d['sync_interval_steps']:.0f} steps" if (
        "sync_interval_steps" in d) else ""  # fmt: skip
    if "utilisation" in d:
        at += f"; {args.run_steps} steps with its end: {100 * d['utilisation']:.1f}%"
    print(f"decoupled  never waits; syncs every H={args.inner_steps} steps from "
          f"{_fmt(d['gbps_to_keep_up'])} Gbit/s{at}")  # fmt: skip
    return 0
