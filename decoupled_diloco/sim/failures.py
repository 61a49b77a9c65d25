"""Failure schedules: when chips fail, and which slice each failure takes down.

A schedule is drawn once and replayed against every system (common random numbers), so the
differences between systems come from how they react, not from luck of the draw.
"""

import dataclasses

import numpy as np

from decoupled_diloco.sim.config import SimConfig


@dataclasses.dataclass(frozen=True)
class FailureSchedule:
    """Chip interruptions, sorted by time.

    Attributes:
        times_s: Failure times, shape [F], non-decreasing.
        slice_ids: Slice hit by each failure, shape [F], in [0, num_slices).
        horizon_s: The schedule is complete up to this time (no failure is missing before it).
    """

    times_s: np.ndarray
    slice_ids: np.ndarray
    horizon_s: float

    def __post_init__(self) -> None:
        if self.times_s.shape != self.slice_ids.shape or self.times_s.ndim != 1:
            raise ValueError("times_s and slice_ids must be 1-D arrays of the same length")
        if self.times_s.size and np.any(np.diff(self.times_s) < 0):
            raise ValueError("times_s must be sorted")


def poisson_schedule(cfg: SimConfig, horizon_s: float) -> FailureSchedule:
    """Draws every chip interruption of the cluster up to `horizon_s`.

    Why the superposed process instead of one clock per chip: N independent exponential clocks
    with mean MTBI superpose to one Poisson process of rate N / MTBI, each event hitting a chip
    chosen uniformly; sampling that is O(failures), not O(chips). A failure that lands on a slice
    that is already down changes nothing, which the engines handle (they thin such events), so the
    rate is exactly right even when many slices are away.

    The draw is prefix-consistent: a longer horizon with the same seed extends, never reshuffles,
    the schedule (gaps are drawn in fixed-size blocks from one generator).

    Args:
        cfg: Chip count, slice size, MTBI and seed.
        horizon_s: Length of simulated time to cover.

    Returns:
        The schedule.
    """
    rng = np.random.default_rng(cfg.seed)
    rate = cfg.failure_rate_per_s
    block = 1 << 16
    gaps_blocks: list[np.ndarray] = []
    slice_blocks: list[np.ndarray] = []
    t_end = 0.0
    while t_end <= horizon_s:
        gaps = rng.exponential(1.0 / rate, size=block)
        slices = rng.integers(0, cfg.num_slices, size=block)
        gaps_blocks.append(gaps)
        slice_blocks.append(slices)
        t_end += float(gaps.sum())
    times_s = np.cumsum(np.concatenate(gaps_blocks))
    keep = times_s <= horizon_s
    return FailureSchedule(
        times_s=times_s[keep], slice_ids=np.concatenate(slice_blocks)[keep], horizon_s=horizon_s
    )


def explicit_schedule(
    failures: list[tuple[float, int]], horizon_s: float = float("inf")
) -> FailureSchedule:
    """Builds a schedule from explicit `(time_s, slice_id)` pairs (any order).

    Args:
        failures: Failure times and the slice (or, with one slice per learner, the learner) hit.
        horizon_s: Time up to which the list is complete; infinite by default (no more failures).

    Returns:
        The sorted schedule.
    """
    if failures:
        arr = np.asarray(failures, dtype=np.float64).reshape(-1, 2)
        order = np.argsort(arr[:, 0], kind="stable")
        times_s, slice_ids = arr[order, 0], arr[order, 1].astype(np.int64)
    else:
        times_s, slice_ids = np.zeros(0), np.zeros(0, dtype=np.int64)
    return FailureSchedule(times_s=times_s, slice_ids=slice_ids, horizon_s=horizon_s)


def learner_of_slice(num_slices: int, num_learners: int) -> np.ndarray:
    """Maps slice id -> learner id, splitting slices into M contiguous, near-equal groups.

    Returns:
        Array of shape [num_slices]; learners differ in size by at most one slice.
    """
    bounds = np.linspace(0, num_slices, num_learners + 1).round().astype(np.int64)
    return np.searchsorted(bounds, np.arange(num_slices), side="right") - 1
