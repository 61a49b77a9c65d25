r"""`python -m tools.replan_wan [--crossing_efficiency=0.8]`: the planner against earlier WAN cells.

The decoupled cells of benchmarks/results/wan.md measured behind `tc tbf` since 2026-12-06, each
with the prediction of the closed form the planner had until it played a run's end out push by
push (`sim.link_end`) and the current planner's. Their workdirs are
gone, so each cell is kept here as its table had it: setting, the link's rate, the run's
steps, measured utilisation and the closed form's prediction. The tables do not print a
cell's step time (its own unlimited run's, which the planner uses), so it is taken as the one
at which the closed form gives the printed prediction (to 1 ms; `step s` below).

The sections (wan.md): "28" = "Decoupled, every setting on one code" (P = 1 on 386116d; its
P = 4 rows, "28-old", predate one transfer at a time each way, 1b575f0); "29" = "One transfer
at a time each way"; "30-*" = "Repeats, the headline over 1000 steps, and `--quick`"; "31" =
"The end played out": six cells run after the planner's first played-out end was committed
(its predictions were written before they finished; review fixes to the model came after).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

from decoupled_diloco.sim import bandwidth
from tools import bench_wan

# (section, setting, rate here Mbit/s, steps, step s, measured, planned by the closed form)
CELLS = (
    ("29", "decoupled e3m0 P=4", 1.039, 200, 0.443, 0.975, 0.975),
    ("29", "decoupled e3m0 P=4", 0.415, 200, 0.445, 0.941, 0.938),
    ("29", "decoupled e3m0 P=4", 0.208, 200, 0.447, 0.870, 0.878),
    ("29", "decoupled e3m0 P=4", 0.104, 200, 0.447, 0.650, 0.764),
    ("29", "decoupled int8 P=4", 1.039, 200, 0.381, 0.945, 0.943),
    ("29", "decoupled int8 P=4", 0.415, 200, 0.380, 0.870, 0.859),
    ("29", "decoupled int8 P=4", 0.208, 200, 0.381, 0.659, 0.731),
    ("29", "decoupled int8 P=4", 0.104, 200, 0.381, 0.507, 0.538),
    ("29", "decoupled none P=4", 1.039, 200, 0.404, 0.701, 0.795),
    ("29", "decoupled none P=4", 0.415, 200, 0.404, 0.485, 0.556),
    ("29", "decoupled none P=4", 0.208, 200, 0.403, 0.270, 0.385),
    ("29", "decoupled none P=4", 0.104, 200, 0.402, 0.151, 0.238),
    ("30-R1", "decoupled e3m0 P=4", 0.142, 200, 0.327, 0.748, 0.764),
    ("30-R2", "decoupled e3m0 P=4", 0.123, 200, 0.378, 0.693, 0.764),
    ("30-R1", "decoupled none P=4", 0.283, 200, 0.351, 0.321, 0.426),
    ("30-R2", "decoupled none P=4", 0.245, 200, 0.336, 0.319, 0.381),
    ("30-quick", "decoupled e3m0 P=4", 0.4885, 200, 0.378, 0.947, 0.938),
    ("30-quick", "decoupled e3m0 P=4", 0.447, 200, 0.414, 0.947, 0.938),
    ("30-1k", "decoupled e3m0 P=4", 0.500, 1000, 0.371, 0.988, 0.987),
    ("30-1k", "decoupled e3m0 P=4", 0.496, 1000, 0.374, 0.988, 0.987),
    ("28", "decoupled e3m0 P=1", 1.413, 200, 0.373, 0.978, 0.975),
    ("28", "decoupled e3m0 P=1", 0.565, 200, 0.372, 0.937, 0.927),
    ("28", "decoupled e3m0 P=1", 0.283, 200, 0.370, 0.878, 0.829),
    ("28", "decoupled e3m0 P=1", 0.141, 200, 0.372, 0.724, 0.695),
    ("28", "decoupled int8 P=1", 1.413, 200, 0.371, 0.958, 0.945),
    ("28", "decoupled int8 P=1", 0.565, 200, 0.371, 0.906, 0.832),
    ("28", "decoupled int8 P=1", 0.283, 200, 0.370, 0.755, 0.698),
    ("28", "decoupled int8 P=1", 0.141, 200, 0.373, 0.648, 0.537),
    ("28", "decoupled none P=1", 1.413, 200, 0.354, 0.650, 0.737),
    ("28", "decoupled none P=1", 0.565, 200, 0.355, 0.617, 0.529),
    ("28", "decoupled none P=1", 0.283, 200, 0.353, 0.345, 0.359),
    ("28", "decoupled none P=1", 0.141, 200, 0.355, 0.262, 0.219),
    ("28-old", "decoupled e3m0 P=4", 1.413, 200, 0.325, 0.976, 0.975),
    ("28-old", "decoupled e3m0 P=4", 0.565, 200, 0.327, 0.946, 0.938),
    ("28-old", "decoupled e3m0 P=4", 0.283, 200, 0.329, 0.899, 0.878),
    ("28-old", "decoupled e3m0 P=4", 0.141, 200, 0.329, 0.709, 0.764),
    ("28-old", "decoupled int8 P=4", 1.413, 200, 0.326, 0.947, 0.951),
    ("28-old", "decoupled int8 P=4", 0.565, 200, 0.324, 0.866, 0.878),
    ("28-old", "decoupled int8 P=4", 0.283, 200, 0.323, 0.706, 0.764),
    ("28-old", "decoupled int8 P=4", 0.141, 200, 0.325, 0.489, 0.575),
    ("28-old", "decoupled none P=4", 1.413, 200, 0.333, 0.782, 0.816),
    ("28-old", "decoupled none P=4", 0.565, 200, 0.334, 0.522, 0.589),
    ("28-old", "decoupled none P=4", 0.283, 200, 0.333, 0.305, 0.413),
    # Run for the played-out end (their step times are their own unlimited runs', measured;
    # the closed form's values as the old code rendered them).
    ("31", "decoupled none P=4", 0.2874, 200, 0.2956, 0.299, 0.388),
    ("31", "decoupled none P=4", 1.4371, 200, 0.2956, 0.802, 0.797),
    ("31", "decoupled e3m0 P=4", 0.1437, 200, 0.3234, 0.689, 0.764),
    ("31", "decoupled int8 P=1", 0.1437, 200, 0.3030, 0.468, 0.490),
    ("31", "decoupled none P=1", 0.2874, 200, 0.3247, 0.298, 0.343),
    ("31", "decoupled int8 P=4", 0.2874, 200, 0.2937, 0.670, 0.746),
)
PARAMS, INNER_STEPS, LEARNERS = 557_696, 50, 4  # (the benchmark's model and M)


def planned(setting: str, mbit: float, steps: int, step_s: float, **plan: float) -> float:
    """The current planner's utilisation for one cell (`bench_wan.Setting.planned`)."""
    s = next(x for x in bench_wan.SETTINGS if x.name == setting)
    w = bandwidth.Workload(PARAMS, INNER_STEPS, step_s)
    common = {"params": w.params, "step_time_s": w.step_time_s, "num_learners": LEARNERS,
              "run_steps": steps}  # fmt: skip
    link = dataclasses.replace(s.decoupled_plan(w, common), **plan)
    return bandwidth.utilisation(link, "decoupled", mbit / 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--crossing_efficiency", type=float,
                        default=bandwidth.LinkPlan.crossing_efficiency)  # fmt: skip
    args = parser.parse_args(argv)
    print("| section | setting | rate here (Mbit/s) | steps | step s | measured "
          "| planned, closed form | Δ | planned now | Δ |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    old, new = [], []
    for section, setting, mbit, steps, step_s, measured, closed in CELLS:
        now = planned(setting, mbit, steps, step_s, crossing_efficiency=args.crossing_efficiency)
        old.append(100 * (closed - measured))
        new.append(100 * (now - measured))
        print(f"| {section} | {setting} | {mbit:g} | {steps} | {step_s:.4g} | {measured:.3f} "
              f"| {closed:.3f} | {old[-1]:+.1f} | {now:.3f} | {new[-1]:+.1f} |")  # fmt: skip
    for name, d in (("closed form", old), ("now", new)):
        rms = math.sqrt(statistics.mean(x * x for x in d))
        print(f"\n{name}: {len(d)} cells, {sum(abs(x) > 10 for x in d)} over 10 points; mean "
              f"{statistics.mean(d):+.1f}, rms {rms:.1f}, largest "
              f"{max(d, key=abs):+.1f} (crossing efficiency {args.crossing_efficiency:g})",
              end="")  # fmt: skip
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
