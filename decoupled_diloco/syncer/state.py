"""The syncer's state and rules, without any transport: fragments, rounds, quorum, grace, merge.

Per fragment p the syncer holds the global values Θ_p (one float32 host vector), the outer
optimizer state and a version. Learners push outer gradients Δ anchored at the version they
hold; a round of fragment p collects pushes and closes once `quorum` live learners have pushed
and the adaptive grace window has passed (or every live learner has pushed). Closing merges the
outer gradients (token weights, RDA, anchoring: `syncer.merge`), applies the outer step and
bumps the version. An open round costs one fragment-sized buffer; the merged values are
written into it, so the previous version stays intact for pulls still reading it.

Late-push rule: a push whose base version is more than `max_staleness` versions behind the
fragment's current version arrived after its round (and `max_staleness` later ones) closed. It
is dropped: acknowledged with `accepted=False, reason="late"`, counted in `late_pushes`, and the
state is unchanged; the learner catches up by pulling the current fragment. With
`max_staleness = 0` this is the paper's rule ("late pushes for a merged round are dropped").

Every merge makes a version, so with quorum 1 and M learners a fragment advances about M
versions per H steps: a learner's push is typically anchored 1-2 versions back although it
belongs to the current schedule round. The default `max_staleness` (4) keeps those; lower it
to drop more stale work, or set 0 for the strict rule.

Idempotency: (learner, fragment, round) identifies a push; a retry of one already handled gets
the first answer again, with `duplicate=True`, and is never counted twice. A learner that
registers again (a restarted process) starts a new incarnation whose rounds count from 0; a
push of an older incarnation is refused, so a replay cannot reopen the rounds of one.

Defence in depth: the server admits only bounded counters and outer-gradient norms
(`syncer.admission`); merges cap each push's share and check their result (`syncer.merge`)
before it is installed. A merge that fails the check is refused: its pushes are dropped
(counted per learner, logged), the version does not move, the outer momentum starts again, and
the log gets a record of the refusal but no values.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.comm import wire
from decoupled_diloco.config import (
    ExperimentConfig,
    budget_units,
    data_leases,
    lease_shards,
    lease_unit,
    max_learners,
    max_push_steps,
    overlap_steps,
)
from decoupled_diloco.core import outer
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.syncer import elastic, merge, view, visibility
from decoupled_diloco.syncer import ledger as ledger_lib
from decoupled_diloco.syncer.payloads import Payload
from decoupled_diloco.syncer.records import (
    Ema,
    FragmentState,
    LearnerInfo,
    Pending,
    Push,
    PushResult,
    grace_window,
)


class PushRefused(ValueError):
    """A push the state refuses before it changes anything (the message says why)."""


class SyncerState:
    """All of the syncer's state, guarded by one lock; transport-free so tests can drive it.

    Args:
      config: the experiment (decoupled, outer and merge settings).
      fragments: the tensor specs of each fragment (`fragments.partition`).
      initial: the initial value of every fragment's tensors (same order as the specs), read
        once, fragment by fragment (an iterator may release each as it is taken).
      clock: time source (seconds); tests may pass a fake one.
      owned: the fragments this syncer (shard) serves; default all. The others keep only
        their specs (no values, no optimizer state) and are refused by the server.
      is_mean_only: a predicate on tensor names: the tensors RDA merges by the plain mean (the
        task's `is_mean_only`); default none.
      is_averaged: a predicate on tensor names: synced state (batch statistics, the task's
        `is_averaged`) that takes the learners' weighted mean, no outer step; default none.
      merge_hook: called in the middle of every merge (new values computed, not installed,
        state lock held); tests pass one to kill the syncer there.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        fragments: Sequence[Sequence[TensorSpec]],
        initial: Iterable[Sequence[np.ndarray]],
        clock: Any = time.monotonic,
        owned: Sequence[int] | None = None,
        is_mean_only: Callable[[str], bool] | None = None,
        is_averaged: Callable[[str], bool] | None = None,
        merge_hook: Callable[[], None] | None = None,
    ):
        self.config, self.clock, self.merge_hook = config, clock, merge_hook
        self.owned = set(range(len(fragments)) if owned is None else owned)
        self.started = clock()  # For the status's uptime (and merges per minute).
        d = config.decoupled
        self.tx = outer.make_outer_optimizer(
            config.outer.lr,
            config.outer.momentum,
            config.outer.nesterov,
            config.outer.delayed_nesterov,
        )
        # A fragment another shard owns keeps its specs but no values (empty placeholders).
        self.fragments, self.math = merge.initial_states(
            config, self.tx, fragments, initial, self.owned, is_mean_only, is_averaged
        )
        # Durability (see `syncer.durability`): `seq` counts changes a restart must not lose;
        # with `durable` set, merged versions wait for a commit (`publish`) to become visible.
        self.durable = False
        self.seq = self.committed_seq = 0
        self.wal: Any = None  # `syncer.wal.WriteAheadLog`, records every change
        # Set when a change could not be logged (a full or failing disk): that change and all
        # after it are in memory only, so none is ever published or acknowledged; the server
        # stops serving and its process exits, and a restart resumes from the log as it is.
        self.wal_failed, self.wal_failed_seq = "", 0
        self.learners: dict[int, LearnerInfo] = {}
        # Joins, restarts, leaves and losses of learners, in order (`syncer.elastic`).
        self.membership: list[dict[str, Any]] = []
        self.live_ids: set[int] = set()
        self.ema_step, self.ema_quorum, self.ema_sync = (Ema(d.ema_decay) for _ in range(3))
        self.merge_log: list[dict[str, Any]] = []
        # How many learners each merge combined: index k counts merges of k outer gradients.
        self.merge_sizes = [0] * (max_learners(config) + 1)
        # The run's data as leases, and which of it merges hold (`syncer.ledger`); None with
        # static shards.
        self.ledger = (
            ledger_lib.Ledger(
                budget_units(config),
                lease_shards(config),
                len(fragments),
                lease_unit(config),
                config.decoupled.max_lease_grants,
            )
            if data_leases(config)
            else None
        )
        self.seen: dict[tuple[int, int, int], PushResult] = {}
        self.lock = threading.Condition()
        self.store: Any = None  # `syncer.payloads.PushStore` of the pushes in open rounds

    def warm_up(self) -> None:
        """Compiles every fragment's outer step now, so the first real round is not slow."""
        for p in sorted(self.owned):
            self.math[p].step.warm_up()

    # Learners (`syncer.elastic`) and commits (`syncer.visibility`) ---------------------------

    def live_learners(self, now: float) -> list[int]:
        """Learners still training whose last message is within `learner_timeout_s`."""
        return elastic.live_learners(self, now)

    def fastest_step_time(self) -> float:
        """The shortest recent step time among live learners (`elastic.fastest_step_time`)."""
        return elastic.fastest_step_time(self)

    def register(self, learner_id: int, mesh: str) -> tuple[list[int], int]:
        """Registers (or re-registers) a learner; returns the fragment versions, its incarnation."""
        return elastic.register(self, learner_id, mesh)

    def heartbeat(self, learner_id: int, **fields: Any) -> list[int]:
        """Records a learner's progress; returns the fragment versions."""
        return elastic.heartbeat(self, learner_id, **fields)

    def versions(self) -> list[int]:
        """Every fragment's published version (what learners may hold); call under the lock."""
        return [f.published for f in self.fragments]

    def publish(self, seq: int, versions: dict[int, tuple[int, list[np.ndarray]]]) -> None:
        """Marks change `seq` durable; makes the given (version, values) visible (`visibility`)."""
        visibility.publish(self, seq, versions)

    def wait_committed(self, seq: int, timeout_s: float) -> bool:
        """Blocks until change `seq` is durable (at once when not `durable`); False on timeout."""
        return visibility.wait_committed(self, seq, timeout_s)

    # Pushes and rounds -----------------------------------------------------------------------

    def push(self, push: Push) -> PushResult:
        """Handles one validated push under the idempotency and late-push rules (module doc).

        A push whose data ranges its fragment already holds (merged or pending) is answered
        not accepted, reason "covered" (`Ledger.held`): no data enters the global model twice.

        Raises:
          PushRefused: a push of an older incarnation of its learner, or one whose counters,
            added to the learner's pending push of the fragment, pass `max_push_steps`.
        """
        with self.lock:
            key = (push.learner_id, push.fragment, push.round)
            frag = self.fragments[push.fragment]
            info = self.learners.setdefault(push.learner_id, LearnerInfo())
            if push.incarnation != info.incarnation:
                raise PushRefused(
                    f"incarnation {push.incarnation} is not the current one ({info.incarnation}): "
                    "the learner registered again since (replays of old rounds are refused)"
                )
            if key in self.seen:
                frag.duplicates += 1
                return dataclasses.replace(self.seen[key], duplicate=True)
            staleness = frag.version - push.base_version
            held = self._held(push)
            if staleness > self.config.decoupled.syncer.max_staleness:
                frag.late += 1
                result = PushResult(False, reason="late", version=frag.version)
            elif held is not None:  # (its Δ is dropped; the learner goes on)
                lease, begin, end = held
                result = PushResult(
                    False,
                    reason=f"{wire.REASON_COVERED}: batches [{begin}, {end}) of lease {lease} "
                    f"are in fragment {push.fragment} already (the lease was handed again)",
                    version=frag.version,
                )
            else:
                previous = frag.pending.get(push.learner_id)
                bound = max_push_steps(self.config, names_data=bool(push.data))
                if previous is not None and previous.steps + push.steps > bound:
                    raise PushRefused(
                        f"steps={push.steps} on top of the pending {previous.steps} pass "
                        f"{bound} (config.max_push_steps)"
                    )
                try:
                    self.add_push(frag, push)
                except Exception as error:  # noqa: BLE001 - a half-done fold: drop the round
                    pushes = [frag.pending[i] for i in sorted(frag.pending)]
                    self.refuse_merge(
                        push.fragment, pushes, f"a fold failed: {type(error).__name__}: {error}"
                    )
                    raise PushRefused(
                        f"the syncer could not fold this push ({type(error).__name__}: {error}); "
                        "its fragment's open round was dropped"
                    ) from None
                frag.accepted += 1
                result = PushResult(True, version=frag.version)
            self.seen[key] = result
            info.pushes += 1
            info.last_seen = self.clock()
            self.record_change("push", key, push)
            self.maybe_close(push.fragment)
            self.lock.notify_all()
            return result

    def _held(self, push: Push) -> list[int] | None:
        """The first data range of `push` its fragment holds already (`Ledger.held`)."""
        if self.ledger is None or not push.data:
            return None
        frag = self.fragments[push.fragment]
        pending = [r for x in frag.pending.values() for r in x.data]
        return self.ledger.held(push.fragment, push.data, pending)

    def add_push(self, frag: FragmentState, push: Push) -> None:
        """Folds an accepted push into its fragment's open round (superseding its earlier one)."""
        self.math[push.fragment].add(frag, push, self._release)
        if frag.first_push_t is None:
            frag.first_push_t = self.clock()

    def pending_gradient(self, p: int, learner_id: int) -> list[np.ndarray]:
        """A pending push's outer gradient as the merge will take it (re-anchored), per tensor."""
        with self.lock:
            frag = self.fragments[p]
            parts = frag.pending[learner_id].parts
            return [
                x.reshape(s.shape)
                for x, s in zip(self.math[p].tensors(frag, parts), frag.specs, strict=True)
            ]

    def _release(self, parts: Sequence[tuple[int, Payload]]) -> None:
        """Stored payloads that no pending push refers to any more (see `PushStore.release`)."""
        if self.store is not None:
            for _, payload in parts:
                self.store.release(payload.path, self.seq + 1)

    def maybe_close(self, p: int) -> None:
        """Starts the grace window at quorum; merges when it has passed or all have pushed."""
        frag, now = self.fragments[p], self.clock()
        if not frag.pending:
            return
        live = self.live_learners(now)
        quorum = min(self.config.decoupled.quorum, max(len(live), 1))
        if len(frag.pending) < quorum:
            return
        if frag.quorum_t is None:
            frag.quorum_t = now
            self.ema_quorum.update(now - frag.first_push_t)
            d, s = self.config.decoupled, self.config.decoupled.syncer
            frag.grace_s = grace_window(
                self.ema_step.get(),
                self.ema_quorum.get(),
                self.ema_sync.get(),
                overlap_steps(self.config),
                d.grace_safety,
                s.max_grace_s,
            )
        everyone = set(live) <= set(frag.pending)
        if everyone or now >= frag.quorum_t + frag.grace_s:
            self.merge_fragment(p)

    def tick(self) -> None:
        """Closes every round whose grace window has passed (call periodically)."""
        with self.lock:
            elastic.check_membership(self)
            for p in range(len(self.fragments)):
                self.maybe_close(p)

    def next_deadline(self) -> float | None:
        """The earliest time a round may close by its grace window, if any is waiting."""
        with self.lock:
            times = [f.quorum_t + f.grace_s for f in self.fragments if f.quorum_t is not None]
            return min(times) if times else None

    def merge_fragment(self, p: int, live: int | None = None) -> None:
        """Closes fragment p's round (see `_close`); a close that fails drops the round.

        The round's sums are changed in place as it closes, so a failure half-way (a push file
        that cannot be read back, memory) cannot be retried: its pushes are dropped as a refused
        merge's are (logged by learner), and the fragment stays as it was.
        """
        try:
            self._close(p, len(self.live_learners(self.clock())) if live is None else live)
        except Exception as error:  # noqa: BLE001 - any failure: the same consistent way out
            frag = self.fragments[p]
            pushes = [frag.pending[i] for i in sorted(frag.pending)]
            self.refuse_merge(p, pushes, f"the merge failed: {type(error).__name__}: {error}")

    def _close(self, p: int, live: int) -> None:
        """Closes fragment p's round (`syncer.merge`) and installs the result if it passes.

        `live`: the live learners the merge's share counts (logged: a replay uses the same).
        """
        t0 = time.perf_counter()
        frag = self.fragments[p]
        pushes = [frag.pending[i] for i in sorted(frag.pending)]
        result = self.math[p].close(frag, pushes, live)
        if isinstance(result, str):
            self.refuse_merge(p, pushes, result)
            return
        frag.opt_state = result.opt_state
        if self.merge_hook is not None:
            self.merge_hook()
        frag.install(
            result.buffer,
            result.norm,
            self.math[p].kept,
            [x.learner_id for x in pushes],
            self.config.decoupled.syncer.max_staleness,
            publish=not self.durable,  # else the committer publishes it once it is on disk
        )
        self.merge_sizes[len(pushes)] += 1
        if self.ledger is not None:
            for x in pushes:
                self.ledger.record_merge(p, x.data)
        now = self.clock()
        emas = {"step": self.ema_step, "quorum": self.ema_quorum, "sync": self.ema_sync}
        self.merge_log.append(
            result.describe(p, frag, pushes, now, {k: v.get() for k, v in emas.items()}, t0)
        )
        frag.end_round()
        frag.closed_t = now
        for x in pushes:
            self._release(x.parts)
        self.record_change("merge", p, live)

    def refuse_merge(self, p: int, pushes: list[Pending], error: str) -> None:
        """Drops a round whose merge failed its check; the fragment stays as it was."""
        frag = self.fragments[p]
        frag.refused_merges += 1
        for x in pushes:
            self.learners.setdefault(x.learner_id, LearnerInfo()).dropped_pushes += 1
        logging.error(
            "[syncer] merge of fragment %d refused (%s): dropped the pushes of learners %s "
            "(steps %s, tokens %s); the fragment stays at version %d",
            p,
            error,
            [x.learner_id for x in pushes],
            [x.steps for x in pushes],
            [x.tokens for x in pushes],
            frag.version,
        )
        frag.end_round()
        # The momentum may carry the same harm (it built up towards this round): start it
        # again, so that the fragment's next honest rounds can merge.
        frag.opt_state = self.math[p].step.init()
        for x in pushes:
            self._release(x.parts)
        self.record_change("refuse", p)  # a restart must not bring the dropped pushes back

    def record_change(self, kind: str, *args: Any) -> None:
        """Counts a change a restart must not lose, and logs it to the write-ahead log if any."""
        self.seq += 1
        if self.wal is not None:
            try:
                self.wal.record(self, kind, *args)
            except OSError as error:
                if not self.wal_failed:
                    self.wal_failed = f"{type(error).__name__}: {error}"
                    self.wal_failed_seq = self.seq
                    logging.error(
                        "[syncer] the write-ahead log failed (%s) at change %d: nothing from it "
                        "on is acknowledged; the syncer stops and resumes from the log on restart",
                        self.wal_failed,
                        self.seq,
                    )
                raise

    # Pulls (`syncer.visibility`) and status (`syncer.view`) ----------------------------------

    def wait_for(
        self,
        p: int,
        min_version: int,
        timeout_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> tuple[int, list[np.ndarray]]:
        """Blocks until fragment p reaches `min_version` (or the timeout); returns its value.

        `alive` (the call still open) is checked while it waits (`visibility.wait_for`).
        """
        return visibility.wait_for(self, p, min_version, timeout_s, alive)

    def record_sync_time(self, p: int, version: int, learner_id: int) -> None:
        """After a pull delivered `version`: time since its round closed (ξ_sync, `visibility`)."""
        visibility.record_sync_time(self, p, version, learner_id)

    def status(self) -> dict[str, Any]:
        """Learners (progress, heartbeat age, staleness), fragments (versions, merges), EMAs."""
        return view.status(self)
