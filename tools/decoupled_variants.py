"""The runs of `tools.bench_decoupled`: settings, variants and their overrides.

Each variant is a name and `--config.*` overrides on top of `DECOUPLED` (M=2, H=50, 300 steps
per learner); the benchmark turns a name into its run directory, so renaming one reruns it.
"""

from __future__ import annotations

SETTING = {"num_learners": 2, "inner_steps": 50, "train_steps": 300}
# The `decoupled.*` defaults these runs were measured with (before gather + share became the
# default on 2026-12-01), pinned so that every variant means what its name says.
BEFORE_GATHER_DEFAULTS = {
    "decoupled.fragments": 2,
    "decoupled.overlap_steps": 1,
    "decoupled.keep_overlap": False,
    "decoupled.apply_on_arrival": False,
    "decoupled.partial_merge": "mean",
    "decoupled.grace_safety": 0.5,
    "decoupled.stale_anchor": "syncer",
    "decoupled.syncer.max_grace_s": 2.0,
}
DECOUPLED = {
    **BEFORE_GATHER_DEFAULTS,
    "decoupled.fragments": 4,
    "decoupled.overlap_steps": 2,
    "decoupled.quorum": 1,
    "outer.merge": "rda",
}
_NESTEROV = {"outer.lr": 0.7, "outer.momentum": 0.9, "outer.nesterov": True}
SGD1 = {"outer.lr": 1.0, "outer.momentum": 0.0, "outer.nesterov": False}
_KEEP = "decoupled.keep_overlap"
KEEP5 = "sgd 1.0/0.0, τ=5, keep overlap"
# M=4 with quorum 1 and a grace window long enough to gather the learners' pushes (τ=10 steps
# of slack, γ=1, up to 10 s) into one merge; the steps trained while waiting are kept.
GATHER = {
    **DECOUPLED,
    **SGD1,
    "decoupled.overlap_steps": 10,
    "decoupled.keep_overlap": True,
    "decoupled.grace_safety": 1.0,
    "decoupled.syncer.max_grace_s": 10,
}
# partial_merge="share" (a merge of k of M learners steps k/M of the way) with each learner's
# own outer gradient: right both for gathered rounds and for lone pushes.
SHARE = {"decoupled.partial_merge": "share", "decoupled.stale_anchor": "learner"}
# (name, overrides on top of DECOUPLED)
VARIANTS = (
    ("nesterov 0.7/0.9", _NESTEROV),
    ("delayed nesterov 0.7/0.9 N=2", {**_NESTEROV, "outer.delayed_nesterov": 2}),
    ("sgd 1.0/0.0", SGD1),
    ("nesterov 0.7/0.9, quorum 2", {**_NESTEROV, "decoupled.quorum": 2}),
    ("sgd 1.0/0.0, quorum 2", {**SGD1, "decoupled.quorum": 2}),
    (
        "learner anchor, sgd 0.5/0.0",
        {**SGD1, "outer.lr": 0.5, "decoupled.stale_anchor": "learner"},
    ),
    (
        "learner anchor, delayed nesterov 0.7/0.9 N=2",
        {**_NESTEROV, "outer.delayed_nesterov": 2, "decoupled.stale_anchor": "learner"},
    ),
    # τ=5 leaves the grace window room to gather both learners' pushes into one merge;
    # keep_overlap keeps the steps trained meanwhile (decoupled.keep_overlap).
    ("sgd 1.0/0.0, τ=5", {**SGD1, "decoupled.overlap_steps": 5}),
    ("sgd 1.0/0.0, τ=5, keep overlap", {**SGD1, "decoupled.overlap_steps": 5, _KEEP: True}),
    # The same command again (a second directory): decoupled runs are not bit-repeatable.
    (
        "sgd 1.0/0.0, τ=5, keep overlap, repeat",
        {**SGD1, "decoupled.overlap_steps": 5, _KEEP: True},
    ),
    # The M=4 tables' best settings; four runs of the same command, for the spread.
    *(
        (f"gather + share, learner anchor{suffix}", {**GATHER, **SHARE})
        for suffix in ("", ", repeat", ", repeat 2", ", repeat 3")
    ),
    # Tried on top of it: plain weighted mean instead of RDA (as diloco merges), and τ=5.
    ("gather + share, mean merge", {**GATHER, **SHARE, "outer.merge": "mean"}),
    ("gather + share, mean merge, repeat", {**GATHER, **SHARE, "outer.merge": "mean"}),
    ("gather + share, τ=5", {**GATHER, **SHARE, "decoupled.overlap_steps": 5}),
    ("gather + share, τ=1", {**GATHER, **SHARE, "decoupled.overlap_steps": 1}),
    # One fragment: is the gap to diloco the streaming of fragments? (It is not.)
    ("gather + share, P=1", {**GATHER, **SHARE, "decoupled.fragments": 1}),
    # Mixing instead of (or on top of) keeping the overlap steps, and outer momentum.
    ("gather + share, α=0.5, no keep", {**GATHER, **SHARE, _KEEP: False, "decoupled.alpha": 0.5}),
    ("gather + share, α=0.5", {**GATHER, **SHARE, "decoupled.alpha": 0.5}),
    (
        "gather + share, nesterov 0.7/0.5",
        {**GATHER, **SHARE, "outer.lr": 0.7, "outer.momentum": 0.5, "outer.nesterov": True},
    ),
    ("gather + share, outer lr 1.2", {**GATHER, **SHARE, "outer.lr": 1.2}),
    ("gather + share, outer lr 0.8", {**GATHER, **SHARE, "outer.lr": 0.8}),
    # From here on, after the return-trip fix (see FIXED_FROM).
    *((f"gather + share, learner anchor, repeat {n}", {**GATHER, **SHARE}) for n in (4, 5)),
    ("gather + share, τ=2", {**GATHER, **SHARE, "decoupled.overlap_steps": 2}),
    ("gather + share, τ=1, again", {**GATHER, **SHARE, "decoupled.overlap_steps": 1}),
    ("gather + share, P=1, again", {**GATHER, **SHARE, "decoupled.fragments": 1}),
    # The nearly synchronous limit: one fragment, both pushes in every merge, no overlap
    # (the learner applies the merge at the first step boundary after it arrives).
    (
        "nearly synchronous, P=1, τ=0, quorum 2",
        {
            **GATHER,
            **SHARE,
            "decoupled.fragments": 1,
            "decoupled.overlap_steps": 0,
            "decoupled.quorum": 2,
        },
    ),
)
# The first variant run after the syncer's return-trip fix (ξ_sync counted only for learners
# whose push a merge holds; a learner's pull waits for the merge holding its push) and the
# host-copy timer fix (the wait for steps dispatched ahead is no longer counted).
FIXED_FROM = "gather + share, learner anchor, repeat 4"
# The heterogeneity runs use the best quorum-1 variant of the first sweep (before τ=5 was tried).
SLOW_VARIANT = "learner anchor, sgd 0.5/0.0"
SLOW = {"slow_learner": 1, "slowdown": 3.0, "eval.every": 50}
# Twice the steps, so that both modes can reach dp's final loss (neither does within 300).
SLOW_STEPS = 600
# M=4 at the foundation's long setting, against `tools.bench_quality`'s long dp/diloco runs.
LONG_DECOUPLED = {
    **DECOUPLED,
    "outer.lr": 0.25,  # 1/M: with quorum 1 each merge holds about one learner's progress
    "outer.momentum": 0.0,
    "outer.nesterov": False,
    "decoupled.stale_anchor": "learner",
}
M4_SHORT = {"num_learners": 4, "inner_steps": 50, "train_steps": 300}
SEEDS = (1, 2)

# The decoupled settings the fault benchmarks (chaos, restart) were measured with
# (tiny_lm_decoupled's before 2026-11-30: τ=2, merges of whatever arrived, outer lr 1/M),
# pinned to stay reproducible. As `--config.KEY` overrides.
TINY_DECOUPLED_BEFORE_GATHER = {
    "outer.lr": 0.5,
    "decoupled.overlap_steps": 2,
    "decoupled.keep_overlap": False,
    "decoupled.grace_safety": 0.5,
    "decoupled.syncer.max_grace_s": 2.0,
    "decoupled.partial_merge": "mean",
    "decoupled.apply_on_arrival": False,
}
# Decoupled runs under faults keep one warm standby learner (docs/chaos.md, "Warm standby"):
# a restart activates it instead of starting a new process.
STANDBY = {"supervisor.standby": 1}
