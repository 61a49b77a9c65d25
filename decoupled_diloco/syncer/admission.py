"""What the syncer admits from the network: bounds on every field a peer sends, as pure checks.

Each check returns None when the input is acceptable, else a message naming the field and the
bound, which the server sends back with INVALID_ARGUMENT. Nothing here touches the state: a
refused message leaves it unchanged.

The bounds (docs/deploy.md, "What the syncer trusts"):
- counters: 1 ≤ steps ≤ `config.max_push_steps` (`train_steps`; on data leases the budget's
  steps) and 1 ≤ tokens ≤ steps · tokens per step (the task's
  batch), so a push cannot claim more work than its steps could have done, a token weight
  tokens²/steps is never 0 and never overflows;
- outer-gradient norm: ‖Δ‖ ≤ `max_delta_norm` · max(‖Θ_p‖, `NORM_FLOOR`·√n) for fragment p of
  n values (a norm that overflows float32 is inf, and refused);
- a merge's result: finite, and its step ‖Θ' − Θ‖ within `merged_step_bound`;
- waits: finite, ≥ 0 (the server also caps them);
- heartbeats: finite numbers, counters ≥ 0, one version per fragment, a state from `STATES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# A heartbeat's counters (bytes, rounds, phase step) are at most this (int64 sums stay safe).
MAX_COUNTER = 1 << 48
# Learner states a heartbeat may report (`learner.sync`).
STATES = frozenset({"training", "done"})

# An all-zero fragment (e.g. only biases at init) still admits outer gradients of RMS ≤ this
# times `max_delta_norm` per value.
NORM_FLOOR = 1e-3


def check_counters(steps: int, tokens: int, max_steps: int, tokens_per_step: int) -> str | None:
    """Bounds a push's inner steps and tokens by what a learner's run could have produced."""
    if not 1 <= steps <= max_steps:
        return f"steps={steps}: must be in [1, {max_steps}] (config.max_push_steps)"
    if not 1 <= tokens <= steps * tokens_per_step:
        return (
            f"tokens={tokens}: must be in [1, steps * tokens_per_step = {steps} * "
            f"{tokens_per_step}] (a learner cannot claim more tokens than its steps produce)"
        )
    return None


def norm(arrays: Sequence[np.ndarray]) -> float:
    """The L2 norm of a list of arrays together (inf if it overflows float32: then refused).

    Each tensor's squared norm is one float32 BLAS dot on a view (no copy: this runs on every
    push at memory speed); one that overflows is inf, and inf exceeds every bound, which is
    the right answer for values that large. The sum over tensors is in float64.
    """
    total = 0.0
    for a in arrays:
        flat = np.asarray(a).reshape(-1)
        if flat.dtype != np.float32:
            flat = flat.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            total += float(np.dot(flat, flat))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def norm_bound(values_norm: float, size: int, ratio: float) -> float:
    """The largest outer-gradient norm admitted for a fragment of `size` values.

    `values_norm` is its global values' norm ‖Θ_p‖ (`FragmentState.norm`).
    """
    return ratio * max(values_norm, NORM_FLOOR * math.sqrt(max(size, 1)))


def check_norm(got: float, values_norm: float, size: int, ratio: float) -> str | None:
    """Refuses an outer-gradient norm `got` above `norm_bound(values_norm, size, ratio)`."""
    bound = norm_bound(values_norm, size, ratio)
    if not got <= bound:
        return (
            f"outer-gradient norm {got:.4g} exceeds the bound {bound:.4g} "
            f"(decoupled.syncer.max_delta_norm={ratio} times the fragment's norm)"
        )
    return None


def merged_step_bound(
    values_norm: float, size: int, ratio: float, lr: float, momentum: float
) -> float:
    """The largest outer step ‖Θ' − Θ‖ a merge of admitted outer gradients can take.

    Merged outer gradients are within `norm_bound` (RDA keeps the weighted mean of norms, the
    mean is at most the largest); an SGD/Nesterov step with momentum β moves at most
    lr/(1 − β) times that. Twice that leaves room for momentum built while Θ was larger.
    """
    return 2.0 * lr / max(1.0 - momentum, 1e-6) * norm_bound(values_norm, size, ratio)


def check_step(step_sq: float, bound: float) -> str | None:
    """Refuses a merge result that is not finite or steps further than `bound`.

    `step_sq` is ‖Θ' − Θ‖² (`core.accumulate.FlatStep`), finite only if every new value is
    (the old ones are).
    """
    if not math.isfinite(step_sq):
        return "the merged values are not finite (or their step overflows)"
    step = math.sqrt(step_sq)
    if not step <= bound:
        return f"the merged outer step {step:.4g} exceeds its bound {bound:.4g}"
    return None


def check_wait(wait_s: float) -> str | None:
    """A pull's wait must be a finite number of seconds ≥ 0."""
    if not (math.isfinite(wait_s) and wait_s >= 0):
        return f"wait_s={wait_s}: must be finite and >= 0"
    return None


def check_heartbeat(
    step: int,
    tokens: int,
    numbers: dict[str, float],
    counters: dict[str, int],
    versions: Sequence[int],
    state: str,
    num_fragments: int,
) -> str | None:
    """Bounds a heartbeat's fields (each one ends up in every Status reply)."""
    if step < 0 or tokens < 0:
        return f"step={step}, tokens={tokens}: must be >= 0"
    for name, value in numbers.items():
        if name in ("loss", "eval_loss") and math.isnan(value):  # NaN: not known yet
            continue
        if not math.isfinite(value) or (name not in ("loss", "eval_loss") and value < 0):
            return f"{name}={value}: must be finite (losses may be NaN), times >= 0"
    for name, value in counters.items():
        if not 0 <= value <= MAX_COUNTER:
            return f"{name}={value}: must be in [0, 2^48]"
    if len(versions) not in (0, num_fragments):
        return f"versions: {len(versions)} entries for {num_fragments} fragments"
    if any(v < 0 for v in versions):
        return "versions: must be >= 0"
    if state and state not in STATES:
        return f"state={state[:40]!r}: must be one of {sorted(STATES)}"
    return None


def fingerprint_mismatch(theirs: str, ours: str) -> str:
    """What differs between a learner's task fingerprint and the syncer's, in words.

    Fingerprints are "TASK@TREE" (`Task.fingerprint`); the learner's is cut to 256 characters.
    """
    their_task, named, their_tree = theirs[:256].rpartition("@")
    our_task, _, our_tree = ours.rpartition("@")
    if not named:
        return (
            f"sent fingerprint {their_tree[:64]!r}, which names no task; the syncer serves "
            f"task {our_task!r} ({ours})"
        )
    if their_task != our_task:
        return f"trains task {their_task!r} but the syncer serves task {our_task!r}"
    return (
        f"has a different parameter tree ({their_tree[:32]}, the syncer's {our_tree}: tree "
        f"structure, shapes or dtypes) for task {our_task!r}"
    )
