"""Goodput and uptime of dp, elastic_dp and decoupled training under chip failures, at any scale.

Examples:
    python -m decoupled_diloco.sim goodput                      # paper setting: 1.2M chips, M=8
    python -m decoupled_diloco.sim goodput --json --num_chips=2400000 --num_learners=16
    python -m decoupled_diloco.sim goodput --sweep --plot=benchmarks/goodput_sweep.png
    python -m decoupled_diloco.sim goodput --salvage_on_failure --background_upscale  # go beyond

Every field of `decoupled_diloco.sim.SimConfig` is a flag (`--name=value`); see docs/simulator.md.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from decoupled_diloco.sim import SYSTEMS, SimConfig, simulate, sweep

DEFAULT_PLOT = "benchmarks/goodput_sweep.png"
DEFAULT_SWEEP_CHIPS = "150000,300000,600000,1200000,2400000"
DEFAULT_SWEEP_LEARNERS = "2,4,8,16"


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--sweep", action="store_true", help="sweep chip counts and M; plot")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG written by --sweep")
    parser.add_argument("--sweep_chips", default=DEFAULT_SWEEP_CHIPS, help="comma-separated")
    parser.add_argument("--sweep_learners", default=DEFAULT_SWEEP_LEARNERS, help="comma-separated")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + str(SYSTEMS)
    )
    defaults = SimConfig()
    for field in dataclasses.fields(SimConfig):
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(
                f"--{field.name}", type=_parse_bool, nargs="?", const=True, default=default
            )
        else:
            parser.add_argument(f"--{field.name}", type=type(default), default=default)
    return parser


def _config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or the device machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        name = row["system"] if row["system"] != "decoupled" else f"decoupled M={row['learners']}"
        series.setdefault(name, []).append((row["chips"], row["goodput"]))
    for name, points in series.items():
        points.sort()
        style = "--" if not name.startswith("decoupled") else "-"
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], style, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("chips (MTBI 1 year per chip)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Simulated goodput, dense 5B, 1T tokens")
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """CLI: simulates (or sweeps) the flags' setting and prints the table (or `--json`)."""
    args = _parser().parse_args(argv)
    cfg = _config(args)
    if args.sweep:
        t0 = time.perf_counter()
        rows = sweep(cfg, _ints(args.sweep_chips), _ints(args.sweep_learners))
        elapsed = time.perf_counter() - t0
        _plot(rows, args.plot)
        if args.json:
            print(json.dumps({"rows": rows, "inputs": dataclasses.asdict(cfg)}, indent=2))
            return
        print(f"{'chips':>10} {'system':>12} {'M':>3} {'goodput':>8} {'uptime':>8}")
        for r in rows:
            print(
                f"{r['chips']:>10} {r['system']:>12} {r['learners']:>3} "
                f"{100 * r['goodput']:>7.1f}% {100 * r['uptime']:>7.2f}%"
            )
        print(f"plot: {args.plot}  ({elapsed:.1f} s)", file=sys.stderr)
        return
    systems = [s for s in args.systems.split(",") if s]
    t0 = time.perf_counter()
    results = simulate(cfg, systems)
    elapsed = time.perf_counter() - t0
    out: dict[str, object] = {
        name: {
            "goodput": r.goodput,
            "uptime": r.uptime,
            "wall_s": r.wall_s,
            "interruptions": r.interruptions,
            "lost": r.lost,
        }
        for name, r in results.items()
    }
    if args.json:
        out["inputs"] = dataclasses.asdict(cfg)
        print(json.dumps(out, indent=2))
        return
    print(
        f"{cfg.num_chips} chips, MTBI {cfg.mtbi_chip_s / 86400:.0f} d/chip, "
        f"cluster MTBF {1 / cfg.failure_rate_per_s:.1f} s, M={cfg.num_learners}, K={cfg.quorum}"
    )
    for name, r in results.items():
        print(
            f"  {name:>10}: goodput {100 * r.goodput:5.1f}%  uptime {100 * r.uptime:6.2f}%  "
            f"wall {r.wall_s / 3600:7.1f} h  interruptions {r.interruptions}"
        )
    print(f"({elapsed:.2f} s)", file=sys.stderr)
