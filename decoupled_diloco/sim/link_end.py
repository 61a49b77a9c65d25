"""The end of a finite decoupled run on one learner's link, played push by push.

After its last step a decoupled learner still has to push what it trained since each
fragment's last push, and, behind a slow link, its pushes and merges under way to see
through. How long that takes depends on where each fragment's round trip stands at the last
step, which the schedule decides, not chance (measured behind kernel rate limits, issue 22:
a closed form that took half a trip as left on average planned one fragment's end at up to
twice the measured one, and four fragments' behind the link at 0.6-0.8 of it; `tools/
replan_wan.py`). So this plays the schedule out:

* Fragment p (of P) is due at steps ⌊(p + 1) H / P⌋ + k H (`core.fragments.offset`, kept
  here as a formula: that module needs JAX, the planner does not). Due while its round trip
  is under way (its merge not back, or back during the last step and not applied yet: that
  happens before the next step), it is held, and pushed at the first step boundary after
  (`learner.push.push_due`, `under_way`).
* A learner's pushes cross its uplink one at a time, and the merges it pulls its downlink
  one at a time (`decoupled.syncer.max_transfers` = 1): a push takes `up_s`, a merge `down_s`,
  each after the latency; the merge starts once its push is delivered and the downlink is
  free (the syncer merges at once: no quorum or grace window is waited for).
* Transfers crossing each other lose a share of the rate: on one TCP connection each call's
  request or reply queues behind the other direction's data (measured:
  `tools/wan_streams.py --calls=4 --duplex`, 0.77 for pushes beside pulls, 0.88 for pulls
  beside pushes). Here one share, `crossing_efficiency`, slows a push that starts while a
  merge is coming down; a merge is placed when its push is, before the pushes that will
  cross it are known, and is not slowed: the one share stands for both directions' loss.
* The end on data leases (`data_leases`) is the pause at the last lease (`learner.push.pause`):
  once no push is crossing, it pushes every fragment with steps since its last push whose
  trip has ended, or all of them once it has waited `trip_wait_s` (`rpc_timeout_s`); again
  until none is left; done when the last push is delivered (its merge comes back, and may
  cross a later push, but is not waited for). Without leases the final flush (`push.flush`)
  waits up to `trip_wait_s` for the trips under way, then pushes every fragment at once and
  waits up to `flush_timeout_s` for their delivery.

Every learner is played as one of T steps whose schedule starts at step 0: on data leases the
learners' step counts differ (the leases they happened to train), and a learner that joins
late takes the phase of the others (`decoupled.align_phase`). Its cost: T P / H pushes of O(P)
each (1e6 steps, P = 8, H = 50: ~0.3 s).
"""

from __future__ import annotations

import math


def end_s(
    run_steps: int,
    step_time_s: float,
    inner_steps: int,
    fragments: int,
    up_s: float,
    down_s: float,
    *,
    latency_s: float,
    crossing_efficiency: float,
    trip_wait_s: float,
    data_leases: bool,
    flush_timeout_s: float,
) -> float:
    """Seconds from a learner's last step until its last push is delivered.

    Args:
      run_steps: T, the learner's steps.
      step_time_s: one step's compute.
      inner_steps: H (>= P).
      fragments: P.
      up_s: one fragment's push at the link's full rate, latency apart.
      down_s: one fragment's merge back at the link's full rate, latency apart.
      latency_s: one-way latency, before each transfer's bytes (it holds its direction).
      crossing_efficiency: the share of the rate a push gets when a merge is coming down as
        it starts (in (0, 1]; 1: none lost).
      trip_wait_s: how long the end waits for a round trip under way before pushing anyway.
      data_leases: the end is the pause at the learner's last lease; else the final flush.
      flush_timeout_s: the final flush's wait for delivery (0: none); not on data leases.

    Returns:
      The end's seconds (0 when nothing is left to push).

    Raises:
      ValueError: P > H, or an efficiency outside (0, 1].
    """
    if fragments > inner_steps:
        raise ValueError(f"fragments ({fragments}) > inner_steps ({inner_steps})")
    if not 0.0 < crossing_efficiency <= 1.0:
        raise ValueError(f"crossing_efficiency must be in (0, 1], got {crossing_efficiency}")
    t, h, n = step_time_s, inner_steps, fragments
    up_free = down_free = 0.0  # when each direction is next free
    back = [0.0] * n  # when fragment p's merge is back
    delivered = [0.0] * n  # when its last push was delivered
    last = [0] * n  # the step of its last push
    due = [(p + 1) * h // n for p in range(n)]
    held = [False] * n

    def push(p: int, step: int, now: float, merge: bool = True) -> None:
        nonlocal up_free, down_free
        start = max(now, up_free)
        share = crossing_efficiency if down_free > start else 1.0
        up_free = delivered[p] = start + latency_s + up_s / share
        last[p], held[p] = step, False
        if merge:  # (its merge starts once the push is in and the downlink is free)
            down_free = back[p] = max(up_free, down_free) + latency_s + down_s

    step = 0
    while True:  # the steps at which a fragment is due, or a held one's merge is applied
        # A merge back during step k is applied before step k + 1 (`apply_arrivals`); until
        # then its fragment is under way (`push.under_way`).
        waits = [max(step + 1, math.ceil(back[p] / t - 1e-9) + 1) for p in range(n) if held[p]]
        step = min(due + waits)
        if step > run_steps:
            break
        for p in range(n):
            is_due = due[p] == step
            if is_due:
                due[p] += h
            if (is_due or held[p]) and back[p] > (step - 1) * t:
                held[p] = True
            elif is_due or held[p]:
                push(p, step, step * t)
    end = now = run_steps * t
    deadline = end + trip_wait_s  # (pushed then whether its trip has ended or not)
    todo = [p for p in range(n) if last[p] < run_steps]
    if not data_leases:  # `push.flush`: `end_trips`, then every fragment at once
        now = min(max([now] + [back[p] for p in todo]), deadline)
        for p in todo:
            push(p, run_steps, now, merge=False)
        done = max([now] + delivered)
        return (min(done, now + flush_timeout_s) if flush_timeout_s else done) - end
    while todo:  # `push.pause`, polled: its pushes are ordinary ones, their merges come back
        now = max([now] + delivered)  # (no push crossing)
        ready = [p for p in todo if back[p] <= now or now >= deadline]
        for p in ready:
            push(p, run_steps, now)
        if not ready:
            now = min(min(back[p] for p in todo), deadline)
        todo = [p for p in todo if p not in ready]
    return max([now] + delivered) - end
