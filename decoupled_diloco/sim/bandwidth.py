"""Planning numbers: compute utilisation a learner can expect on a link, and the bandwidth it needs.

Examples:
    python -m decoupled_diloco.sim bandwidth --params=1B --step_time_s=0.1  # H=100, P=8, 4 bit
    python -m decoupled_diloco.sim bandwidth --params=12B --step_time_s=1 \
        --bandwidth_gbps=2.5 --json
    python -m decoupled_diloco.sim bandwidth --paper_table  # beside Streaming DiLoCo, Table 4

The model (a closed form, not a simulation) and every assumption it makes:

* One inner step costs `step_time_s` of compute. The last `backward_fraction` of it (the backward
  pass: 2/3 of a transformer step's FLOPs) can hide communication that starts with the step, as in
  Streaming DiLoCo's simulation, where (outer-)gradient reductions overlap the backward pass.
* Bytes on the wire per learner and direction, for a payload of `n` parameters at `b` bits:
  `allreduce` topology (M learners, ring all-reduce): `2 (M-1)/M * n * b`, full duplex;
  `syncer` topology (this framework: learner <-> syncer star): up `n * b`, down `n * down_bits`,
  full duplex, so the slower direction counts. With M = 2 both topologies move the same bits.
  A transfer takes `latency_s + bits / bandwidth`. Nothing else (no protocol overhead, no
  congestion, no stragglers, no failures: the goodput simulator models those), except in
  a decoupled run's end, below, where transfers crossing each other lose a measured share.
* `dp`: every step all-reduces the full gradient at `dp_bits` (bf16 = 16); the step waits for the
  part of the transfer that the backward pass does not hide:
  `wall = t + max(0, c - backward_fraction * t)`.
* `diloco`: every H steps the whole model's outer gradient at `dp_bits`, hidden only by one
  backward pass (no overlap across steps). Through a syncer the merge needs every learner's
  push before any pull can start, so up and down follow each other: `n * 2 * dp_bits` (the
  duplex max counted half of it; not yet held against a measured diloco run).
* `streaming` (Streaming DiLoCo): P fragments of N/P parameters,
  each synced every H steps at staggered offsets, at `bits` (4 = FP4/int4 outer gradients). A
  fragment's transfer may run for `tau` further steps plus one backward pass before the learner
  needs the merged values; beyond that window the learner waits. Transfers share the link one at a
  time, so if P transfers do not fit in H steps the link is the bottleneck:
  `wall per H steps = max(H t + P * max(0, c_p - (tau + backward_fraction) t), P * c_p)`.
* `decoupled` (this framework's decoupled mode, as it runs): the same fragments and transfers as
  `streaming`, but the learner never waits for them: a fragment due while its last round trip is
  under way is held (the learner steps on) and pushed with every step since when the trip ends;
  merges are applied when they arrive. A long run's utilisation is 1; what a slow link costs is
  staleness, each fragment synced every `sync_interval_steps = max(H, P * c_p / t, trip / t)`
  steps instead of H, where a fragment's round trip `trip` is its push and then its merge back
  (`latency_s` and N/P parameters at `bits`, then at `down_bits`: with P = 1 the legs cannot
  overlap other fragments' and a link must carry twice the model's bits per H steps to keep
  up). (Measured behind kernel rate
  limits, tools/bench_wan.py: 0.997-1.000 without the final flush at every scaled rate, where
  `streaming`'s wait predicted 0.88 at the slowest; that is why this mode exists.)
* A finite run (`run_steps` = T > 0; 0: a run long enough that its end does not count) ends
  with the final flush: every fragment's last push, `N * bits` up (nothing comes back), after
  T/H rounds; for `diloco` it replaces the last round's push and pull. For `decoupled` the end
  is played out push by push on one learner's link (`sim.link_end`, whose docstring lists
  what it models and what not): the schedule decides where each fragment's round trip stands
  at the last step, the pushes and merges still under way cross the link one at a time each
  way, a push that starts while a merge comes down gets `crossing_efficiency` of the rate,
  and the end waits up to `trip_wait_s` for a trip under way before pushing that fragment
  anyway. On data leases (`data_leases`, the framework's default) the end is the pause at the
  learner's last lease, which waits for every push to be delivered, with no bound; without
  them the final flush waits up to `flush_timeout_s` for delivery. (Behind kernel rate
  limits, tools/bench_wan.py: decoupled runs of 200 steps lost 2-85% of their time to it,
  0-5% elsewhere; against the 49 such runs recorded, `tools/replan_wan.py`, this is within
  8.9 points of every one, rms 2.9, where the closed form it replaced, half a trip left on
  average, was over 10 points in five, rms 5.9.) The initial pull of the global parameters
  happens before the first step and is not counted.
* Utilisation = compute time / wall time. It rises monotonically with bandwidth, so the bandwidth
  for a target utilisation is found by bisection; `inf` when latency alone rules the target out.

Against Streaming DiLoCo's simulated Table 4 (H=100, two workers, FP4, 1B / 10B / 100B models at
0.1 / 0.8 / 4.9 s per step), this reproduces the 95% column within 1.25x for both data-parallel and
streaming, with P = 8 / 16 / 40 fragments. That P follows the paper's 3 transformer layers per
fragment for 24 / 48 / 120 layers: the layer counts are our assumption, the table does not list
them. The paper's 99% column is higher than this model gives (its simulator has effects we do not
model, e.g. per-layer scheduling); treat numbers above ~95% as optimistic.
"""

import argparse
import dataclasses
import math

from decoupled_diloco.sim import link_end

MODES = ("dp", "diloco", "streaming")  # the tables; `utilisation` also takes "decoupled"
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}

# Streaming DiLoCo, Table 4 ([P] in reference/literature.md): Gbit/s for 50/80/90/95/99%
# utilisation. Fragment counts are ours (3 layers per fragment on 24 / 48 / 120 layers), see the
# module docstring.
PAPER_TABLE = (
    # (params, step_time_s, fragments, dp Gbit/s, streaming+overlap+FP4 Gbit/s)
    (1e9, 0.1, 8, (86.8, 152.6, 184.2, 222.3, 569.0), (0.4, 0.9, 1.7, 2.0, 3.0)),
    (10e9, 0.8, 16, (104.8, 222.3, 222.3, 268.3, 471.5), (0.4, 0.9, 1.4, 1.4, 1.7)),
    (100e9, 4.9, 40, (184.2, 323.8, 390.7, 390.7, 471.5), (0.5, 0.9, 1.1, 1.1, 1.4)),
)
PAPER_DILOCO_1B_95 = 23.3  # Gbit/s, vanilla DiLoCo, 1B model, 95% (same source)


@dataclasses.dataclass(frozen=True)
class LinkPlan:
    """The inputs of the model (module doc): the flags of `sim bandwidth`, same names.

    Attributes:
      params: model size in parameters.
      step_time_s: compute time of one inner step.
      inner_steps: H, steps between syncs of a fragment.
      fragments: P, fragments staggered over H.
      overlap_steps: τ, steps a fragment's sync may overlap.
      bits: bits per parameter of the outer gradient.
      down_bits: syncer -> learner bits per parameter (0: `bits`).
      dp_bits: bits per parameter for dp and diloco.
      num_learners: M.
      topology: "syncer" (learner <-> syncer star) or "allreduce" (ring).
      latency_s: one-way latency per transfer.
      backward_fraction: the share of a step that can hide communication.
      bandwidth_gbps: the link, for its utilisation; 0: only the bandwidth each target needs.
      targets: utilisation targets.
      run_steps: T, the run's length, whose final flush then counts (0: a long run).
      data_leases: decoupled: learners train on data leases (`decoupled.data_shards`, the
        default): a run's end is the pause at the last lease, unbounded; else the final flush.
      flush_timeout_s: decoupled without data leases: the longest the final flush waits for
        its pushes' delivery (2 × `decoupled.syncer.rpc_timeout_s`); 0: no bound.
      trip_wait_s: decoupled: how long a learner's end waits for a fragment's round trip
        under way before pushing it anyway (`decoupled.syncer.rpc_timeout_s`).
      crossing_efficiency: decoupled, a finite run's end (`sim.link_end`): the share of the
        link's rate a push gets while a merge comes down on the learner's connection (each
        call's request or reply queues behind the other direction's data). Measured behind
        `tc tbf` at 0.283 Mbit/s, four 0.59 MB calls one after another each way at once
        (`tools/wan_streams.py --calls=4 --duplex`): 0.77 for the pushes, 0.88 for the pulls,
        0.98 each alone.
    """

    params: float = 1e9
    step_time_s: float = 0.1
    inner_steps: int = 100
    fragments: int = 8
    overlap_steps: float = 1.0
    bits: float = 4.0
    down_bits: float = 0.0
    dp_bits: float = 16.0
    num_learners: int = 2
    topology: str = "syncer"
    latency_s: float = 0.0
    backward_fraction: float = 2 / 3
    bandwidth_gbps: float = 0.0
    targets: tuple[float, ...] = TARGETS
    run_steps: int = 0
    data_leases: bool = True
    flush_timeout_s: float = 120.0
    trip_wait_s: float = 60.0
    crossing_efficiency: float = 0.8


def parse_count(text: str) -> float:
    """Parses a parameter count such as `1e9`, `1.3B`, `350M`.

    Raises:
      argparse.ArgumentTypeError: not a positive number with an optional K/M/B/T suffix.
    """
    value = text.strip()
    scale = _SUFFIX.get(value[-1:].upper(), 1.0) if value else 1.0
    if scale != 1.0:
        value = value[:-1]
    try:
        count = float(value) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (e.g. 1e9, 1.3B)"
        ) from None
    if not count > 0:
        raise argparse.ArgumentTypeError(f"parameter count must be > 0, got {text!r}")
    return count


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


def _transfer_s(args: LinkPlan, params: float, bits: float, gbps: float) -> float:
    """Seconds one payload of `params` parameters occupies this learner's link."""
    if args.topology == "allreduce":
        m = args.num_learners
        wire = 2.0 * (m - 1) / m * params * bits
    else:  # syncer star: up and down in parallel (full duplex); the slower direction counts
        wire = params * max(bits, args.down_bits or bits)
    return args.latency_s + wire / (gbps * 1e9)


def _legs_s(args: LinkPlan, gbps: float) -> tuple[float, float]:
    """Seconds of one fragment's push and of its merge back at `gbps`, latency apart."""
    values = args.params / args.fragments
    return values * args.bits / (gbps * 1e9), values * (args.down_bits or args.bits) / (gbps * 1e9)


def _trip_s(args: LinkPlan, gbps: float) -> float:
    """Seconds of one fragment's round trip in decoupled mode: its push, then its merge back.

    The two legs follow each other (the merge needs the push), each in its own direction.
    """
    return 2 * args.latency_s + sum(_legs_s(args, gbps))


def utilisation(args: LinkPlan, mode: str, gbps: float) -> float:
    """Fraction of wall-clock time spent computing, for `mode` on a `gbps` Gbit/s link."""
    _positive("bandwidth", gbps)
    t, hide = args.step_time_s, args.backward_fraction * args.step_time_s
    if mode == "dp":
        c = _transfer_s(args, args.params, args.dp_bits, gbps)
        return t / (t + max(0.0, c - hide))
    h = args.inner_steps
    rounds = args.run_steps / h if args.run_steps else 0.0
    if mode == "diloco":
        c = _transfer_s(args, args.params, args.dp_bits, gbps)
        if args.topology == "syncer":  # the push, the merge, then the pull: one after the other
            c = 2 * args.latency_s + args.params * 2 * args.dp_bits / (gbps * 1e9)
        wall = h * t + max(0.0, c - hide)
        if not rounds:
            return h * t / wall
        flush = args.latency_s + args.params * args.dp_bits / (gbps * 1e9)
        return rounds * h * t / ((rounds - 1) * wall + h * t + flush)
    if mode == "streaming":
        p = args.fragments
        c = _transfer_s(args, args.params / p, args.bits, gbps)
        window = args.overlap_steps * t + hide
        wall = max(h * t + p * max(0.0, c - window), p * c)
        if not rounds:
            return h * t / wall
        flush = args.latency_s + args.params * args.bits / (gbps * 1e9)  # all P, up only
        return rounds * h * t / (rounds * wall + flush)
    if mode == "decoupled":
        if not rounds:
            return 1.0
        up_s, down_s = _legs_s(args, gbps)
        flush = link_end.end_s(
            args.run_steps, t, h, args.fragments, up_s, down_s,
            latency_s=args.latency_s, crossing_efficiency=args.crossing_efficiency,
            trip_wait_s=args.trip_wait_s, data_leases=args.data_leases,
            flush_timeout_s=args.flush_timeout_s,
        )  # fmt: skip
        return args.run_steps * t / (args.run_steps * t + flush)
    raise ValueError(f"unknown mode {mode!r}; expected one of {(*MODES, 'decoupled')}")


def sync_interval_steps(args: LinkPlan, gbps: float) -> float:
    """Steps between a fragment's syncs in decoupled mode: H, or longer when the link is behind.

    Behind, either the P fragments' pushes do not fit in H steps (P c_p > H t), or one
    fragment's round trip, its push then its merge back, does not (the bound for P = 1).
    """
    _positive("bandwidth", gbps)
    c = _transfer_s(args, args.params / args.fragments, args.bits, gbps)
    slowest = max(args.fragments * c, _trip_s(args, gbps))
    return max(float(args.inner_steps), slowest / args.step_time_s)


def bandwidth_to_keep_up(args: LinkPlan) -> float:
    """Smallest bandwidth (Gbit/s) at which decoupled syncs every H steps; inf when none does."""
    p, ht = args.fragments, args.inner_steps * args.step_time_s
    pushes = p * (_transfer_s(args, args.params / p, args.bits, 1.0) - args.latency_s)
    trip = _trip_s(args, 1.0) - 2 * args.latency_s
    needs = [(pushes, ht - p * args.latency_s), (trip, ht - 2 * args.latency_s)]
    return max(wire / room if room > 0 else math.inf for wire, room in needs)


def bandwidth_for(args: LinkPlan, mode: str, target: float) -> float:
    """Smallest bandwidth (Gbit/s) giving utilisation >= target; inf when none does."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target utilisation must be in (0, 1), got {target}")
    lo, hi = 1e-9, 1e9
    if utilisation(args, mode, hi) < target:
        return math.inf  # latency (or a window too short at any speed) rules it out
    for _ in range(200):  # bisection in log space: 1e-9..1e9 to ~1e-12 relative
        mid = math.sqrt(lo * hi)
        if utilisation(args, mode, mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-9:
            break
    return hi


def plan(args: LinkPlan) -> dict:
    """Bandwidth per target and (with --bandwidth_gbps) utilisation, for every mode."""
    check_args(args)
    out: dict = {"inputs": dataclasses.asdict(args)}
    for mode in MODES:
        row = {f"gbps_for_{round(100 * q)}pct": bandwidth_for(args, mode, q) for q in args.targets}
        if args.bandwidth_gbps:
            row["utilisation"] = utilisation(args, mode, args.bandwidth_gbps)
        out[mode] = row
    # Decoupled never waits (utilisation 1 in a long run): what its link decides is how often
    # each fragment syncs.
    out["decoupled"] = {"gbps_to_keep_up": bandwidth_to_keep_up(args)}
    if args.bandwidth_gbps:
        out["decoupled"]["sync_interval_steps"] = sync_interval_steps(args, args.bandwidth_gbps)
        if args.run_steps:  # (what its end costs a run of that length)
            out["decoupled"]["utilisation"] = utilisation(args, "decoupled", args.bandwidth_gbps)
    if args.topology == "syncer":
        # The syncer (all shards together) carries every learner's traffic.
        gb95 = out["streaming"].get("gbps_for_95pct")
        if gb95 is not None:
            out["streaming"]["syncer_total_gbps_for_95pct"] = gb95 * args.num_learners
    return out


def check_args(args: LinkPlan) -> None:
    """Validates the inputs, naming the bad one."""
    for name in ("params", "step_time_s", "bits", "dp_bits"):
        _positive(name, getattr(args, name))
    for name in ("inner_steps", "fragments", "num_learners"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.topology == "allreduce" and args.num_learners < 2:
        raise ValueError("allreduce topology needs num_learners >= 2")
    if args.fragments > args.inner_steps:
        raise ValueError(f"fragments ({args.fragments}) > inner_steps ({args.inner_steps})")
    if args.run_steps and args.run_steps < args.inner_steps:
        raise ValueError(f"run_steps ({args.run_steps}) must be 0 or >= inner_steps")
    if args.overlap_steps < 0 or args.latency_s < 0 or args.down_bits < 0:
        raise ValueError("overlap_steps, latency_s and down_bits must be >= 0")
    if args.trip_wait_s < 0:
        raise ValueError(f"trip_wait_s must be >= 0, got {args.trip_wait_s}")
    if not 0.0 < args.crossing_efficiency <= 1.0:
        raise ValueError(f"crossing_efficiency must be in (0, 1], got {args.crossing_efficiency}")
    if not 0.0 <= args.backward_fraction <= 1.0:
        raise ValueError(f"backward_fraction must be in [0, 1], got {args.backward_fraction}")
    if args.bandwidth_gbps < 0:
        raise ValueError(f"bandwidth_gbps must be >= 0, got {args.bandwidth_gbps}")


def paper_rows() -> list[dict]:
    """This model next to Streaming DiLoCo's Table 4 (two workers, H=100, FP4, tau=1)."""
    rows = []
    for params, step, frags, dp_ref, st_ref in PAPER_TABLE:
        args = LinkPlan(
            params=params, step_time_s=step, fragments=frags, topology="allreduce", num_learners=2
        )
        for mode, ref in (("dp", dp_ref), ("streaming", st_ref)):
            ours = [bandwidth_for(args, mode, q) for q in TARGETS]
            rows.append(
                {"params": params, "step_time_s": step, "mode": mode, "ours": ours, "paper": ref}
            )
    return rows


@dataclasses.dataclass(frozen=True)
class Workload:
    """What sets a learner's communication-to-computation ratio: N, H and the step time.

    A learner sends N·b/P bits of outer gradient every H/P steps of s seconds; over a link of B
    bit/s that takes N·b/(P·B) seconds against H·s/P of compute: a ratio of N·b/(B·H·s),
    whatever P.
    """

    params: float
    inner_steps: int
    step_time_s: float


# The paper's 12B run over 2-5 Gbit/s (literature.md, "Bandwidth and WAN"): N = 12e9 is the
# paper's; H = 100 is Table 4's setting, an assumption for the 12B run; the step time 1 s is an
# assumption too, between Table 4's 10B (0.8 s) and 100B (4.9 s) at 60% MFU.
PAPER_12B = Workload(params=12e9, inner_steps=100, step_time_s=1.0)


def scaled_bandwidth(bandwidth_bps: float, source: Workload, target: Workload) -> float:
    """The bandwidth at which `target` has `source`'s communication/computation ratio at B.

    Equal bits per value on both sides (the link is what is scaled; an encoding is then
    compared on equal terms): B_target = B · (N_t / N_s) · (H_s · s_s) / (H_t · s_t).
    """
    _positive("bandwidth_bps", bandwidth_bps)
    for side, w in (("source", source), ("target", target)):
        for field in ("params", "inner_steps", "step_time_s"):
            _positive(f"{side}.{field}", getattr(w, field))
    ratio = (target.params / source.params) * (
        source.inner_steps * source.step_time_s / (target.inner_steps * target.step_time_s)
    )
    return bandwidth_bps * ratio
