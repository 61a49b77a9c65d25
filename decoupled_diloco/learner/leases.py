"""A learner's training data: leases from the syncer's data ledger, or its static shard.

With data leases (`decoupled.data_shards` > 0, see `syncer.ledger`) the learner asks the syncer
for a lease, trains its batches (lease k is the dataset's shard k of S: the same data order
whoever trains it), and asks for the next one as it starts (so a syncer outage at a lease's
end costs no step). Every batch comes with where it is from
((lease, position): the link reports it with each push). When no lease is free but leases
that other live learners hold are not covered yet, the learner pushes everything it trained
(`on_idle`, polled until its work is settled: `DecoupledSync.pause`) and asks again every
`poll_s`: a learner that dies meanwhile
leaves its lease to it. A single-process learner polls its pause between two asks for up to
`settle_s`, without calling the syncer: behind a slow link a lease call waits seconds behind
the push data, and each step of the pause (a round trip ended, its fragment pushed) waited
for one. It stops when the syncer says the whole budget is covered.

Without leases (static shards), learner i trains its shard i of M for `train_steps` steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import jax
import numpy as np

Batch = Any
# Where a step's data is from: [[lease, begin, end), ...] ledger units (`syncer.ledger`), or
# None (static shards).
Where = list[list[int]] | None
_SETTLE_POLL_S = 0.02  # between two polls of a pause that has not settled (`settle_s`)


def leased_batches(
    dataset: Any,
    batch_size: int,
    seed: int,
    ask: Callable[[bool], Any],
    start: Callable[[Any], None],
    on_idle: Callable[[], bool],
    stop: threading.Event,
    poll_s: float = 0.5,
    log: Callable[[str], None] = print,
    ahead: bool = True,
    units_per_step: Callable[[], int] = lambda: 1,
    settle_s: float = 0.0,
) -> Iterator[tuple[Batch, Where]]:
    """Steps' batches from the leases the syncer hands out, each with its data ranges.

    A step trains `units_per_step()` ledger units (asked anew for each step), concatenated
    (one unit: as drawn); a step ends early at the end of a lease and where a lease handed
    again is covered by some fragment (`Grant.covered`), so that no step's data is partly
    covered for a fragment (`DecoupledSync.lease_started`).

    Args:
      dataset: the run's `Dataset` (its `train_iterator(batch_size, k, S, seed)` is lease k).
      batch_size: rows per ledger unit (`config.lease_unit`: a batch, unless the global batch
        is constant).
      seed: the run's seed (the data order within each shard).
      ask: asks the syncer for a lease (`SyncerClient.lease`); given whether everything
        trained so far has been pushed.
      start: called with a grant before its first batch (the link's `lease_started`).
      on_idle: pushes everything trained so far (called before waiting for a lease, and
        while waiting until it returns True: all of it delivered and its merges back).
        Only then may the syncer hand a hole in a lease this learner holds back to it
        (`flushed`): a push still crossing a slow link would otherwise have its batches
        trained again.
      stop: set to stop at the next batch (a learner leaving).
      poll_s: how often to ask again while no lease is free.
      log: where lease changes are reported.
      ahead: as a lease starts, ask for the next one in a thread, so that a syncer outage at
        a lease's end does not stop training (a learner holds at most two leases). A
        multi-process island, whose processes must ask together, asks at the lease's end.
      units_per_step: how many units the next step trains (`config.units_per_step`).
      settle_s: while no lease is free, how long `on_idle` is polled between two asks until
        it says settled (0: once per ask, as the processes of a multi-process island poll
        together).
    """
    flushed = False
    pool = futures.ThreadPoolExecutor(1, thread_name_prefix="lease-ahead") if ahead else None
    coming: futures.Future | None = None  # the next lease, asked for as this one started
    try:
        while not stop.is_set():
            grant = coming.result() if coming is not None else ask(flushed)
            coming = None
            if grant.status == "granted":
                start(grant)
                if pool is not None:
                    coming = pool.submit(ask, False)
                batches = dataset.train_iterator(batch_size, grant.lease, grant.num_shards, seed)
                for _ in range(grant.begin):  # positions already covered: the same order again
                    next(batches)
                if grant.begin:
                    log(f"lease {grant.lease} from batch {grant.begin} of {grant.end} (again)")
                cuts = {c for c in grant.covered if grant.begin < c < grant.end}
                position = grant.begin
                while position < grant.end:
                    if stop.is_set():
                        return
                    end = min(
                        [grant.end, position + max(units_per_step(), 1)]
                        + [c for c in cuts if c > position]
                    )
                    units = [next(batches) for _ in range(end - position)]
                    yield _concatenate(units), [[grant.lease, position, end]]
                    position = end
                flushed = False
            elif grant.status == "wait":
                if not flushed:
                    flushed = _settle(on_idle, stop, settle_s)
                stop.wait(poll_s)
            elif grant.status == "done":
                return
            else:
                raise RuntimeError(
                    f"the syncer hands no data leases (status {grant.status!r}): it was started "
                    "with decoupled.data_shards=0 or several shards; start learners and syncer "
                    "from the same config"
                )
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _settle(on_idle: Callable[[], bool], stop: threading.Event, settle_s: float) -> bool:
    """Polls `on_idle` until it says settled, for up to `settle_s` (once at least)."""
    deadline = time.monotonic() + settle_s
    while not on_idle():
        if time.monotonic() >= deadline or stop.wait(_SETTLE_POLL_S):
            return False
    return True


def _concatenate(units: list[Batch]) -> Batch:
    """One batch of consecutive units (arrays, or dicts of arrays, with a leading batch axis)."""
    if len(units) == 1:
        return units[0]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *units)


def static_batches(
    dataset: Any,
    batch_size: int,
    learner_id: int,
    num_learners: int,
    seed: int,
    steps: int,
    stop: threading.Event,
    batches: Any = None,
) -> Iterator[tuple[Batch, Where]]:
    """`steps` batches of learner `learner_id`'s static shard (`batches`: its iterator)."""
    if batches is None:
        batches = dataset.train_iterator(batch_size, learner_id, num_learners, seed)
    for _ in range(steps):
        if stop.is_set():
            return
        yield next(batches), None
