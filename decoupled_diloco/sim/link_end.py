"""The end of a finite decoupled run on one learner's link, played push by push.

After its last step a decoupled learner still has to push what it trained since each
fragment's last push, and, behind a slow link, its pushes and merges under way to see
through. How long that takes depends on where each fragment's round trip stands at the last
step, which the schedule decides, not chance (measured behind kernel rate limits, issue 22:
a closed form that took half a trip as left on average planned one fragment's end at up to
twice the measured one, and four fragments' behind the link at 0.6-0.8 of it; `tools/
replan_wan.py`). So this plays the schedule out:

* Fragment p (of P) is due at steps ⌊(p + 1) H / P⌋ + k H (`core.fragments.offset`, kept
  here as a formula: that module needs JAX, the planner does not). Due while its
  round trip is under way, it is held, and pushed at the first step after the trip ends
  (`learner.push.push_due`).
* A learner's pushes cross its uplink one at a time, and the merges it pulls its downlink
  one at a time (`decoupled.syncer.max_transfers` = 1): a push takes `up_s`, a merge `down_s`,
  the merge starting once its push is delivered and the downlink free.
* A transfer that crosses one in the other direction gets `crossing_efficiency` of the
  link's rate: on one TCP connection each call's request or reply queues behind the other
  direction's data (measured: `tools/wan_streams.py --calls=4 --duplex`).
* The end on data leases (`leased`) is the pause at the last lease (`learner.push.pause`):
  once no push is crossing, it pushes every fragment with steps since its last push whose
  trip has ended, or all of them once it has waited `trip_wait_s` (`rpc_timeout_s`); again
  until none is left; done when the last push is delivered (its merge is not waited for).
  Without leases the final flush (`push.flush`) waits up to `trip_wait_s` for the trips
  under way, then pushes every fragment at once.
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
    crossing_efficiency: float = 1.0,
    trip_wait_s: float = 60.0,
    leased: bool = True,
) -> float:
    """Seconds from a learner's last step until its last push is delivered.

    Args:
      run_steps: T, the learner's steps.
      step_time_s: one step's compute.
      inner_steps: H.
      fragments: P.
      up_s: one fragment's push at the link's full rate (latency included).
      down_s: one fragment's merge back at the link's full rate.
      crossing_efficiency: the share of the rate a transfer gets while one in the other
        direction crosses it (1: none lost).
      trip_wait_s: how long the end waits for a round trip under way before pushing anyway.
      leased: the end is the pause at the learner's last lease (else the final flush).
    """
    t, h, n = step_time_s, inner_steps, fragments
    up_free = down_free = 0.0  # when each direction is next free
    back = [0.0] * n  # when fragment p's merge is back
    delivered = [0.0] * n  # when its last push was delivered
    last = [0] * n  # the step of its last push
    due = [(p + 1) * h // n for p in range(n)]
    held = [False] * n

    def leg(free: float, other_free: float, now: float, seconds: float) -> float:
        start = max(now, free)
        return start + (seconds / crossing_efficiency if other_free > start else seconds)

    def push(p: int, step: int, now: float, final: bool = False) -> None:
        nonlocal up_free, down_free
        up_free = delivered[p] = leg(up_free, down_free, now, up_s)
        last[p], held[p] = step, False
        if not final:  # (a push at the end is not waited for past its delivery)
            down_free = back[p] = leg(down_free, up_free, up_free, down_s)

    step = 0
    while True:  # the steps at which a fragment is due, or a held one's trip has ended
        waits = [max(step + 1, math.ceil(back[p] / t - 1e-9)) for p in range(n) if held[p]]
        step = min(due + waits)
        if step > run_steps:
            break
        now = step * t
        for p in range(n):
            is_due = due[p] == step
            if is_due:
                due[p] += h
            if (is_due or held[p]) and back[p] > now:
                held[p] = True
            elif is_due or held[p]:
                push(p, step, now)
    end = now = run_steps * t
    deadline = end + trip_wait_s  # (pushed then whether its trip has ended or not)
    todo = [p for p in range(n) if last[p] < run_steps]
    if not leased:
        now = min(max([now] + [back[p] for p in todo]), deadline)
        for p in todo:
            push(p, run_steps, now, final=True)
        return max([now] + delivered) - end
    while todo:
        now = max([now] + delivered)  # (no push crossing)
        ready = [p for p in todo if back[p] <= now or now >= deadline]
        for p in ready:
            push(p, run_steps, now, final=True)
        if not ready:
            now = min(min(back[p] for p in todo), deadline)
        todo = [p for p in todo if p not in ready]
    return max([now] + delivered) - end
