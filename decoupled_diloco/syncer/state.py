"""The syncer's state and rules, without any transport: fragments, rounds, quorum, grace, merge.

Per fragment p the syncer holds the global values Θ_p (one float32 host vector), the outer
optimizer state and a version. Learners push outer gradients Δ anchored at the version they
hold; a round of fragment p collects pushes and closes once `quorum` live learners have pushed
and the adaptive grace window has passed (or every live learner has pushed). Closing merges the
outer gradients with token weights w = tokens²/steps (RDA, or the weighted mean for the task's
mean-only tensors), applies the outer step and bumps the version: the same merge as
`core.outer.outer_round` (which the synchronous `diloco` trainer calls), computed as the pushes
arrive. Memory does not grow with the number of learners: each push is folded into the round's
sums when it arrives (`core.accumulate.RoundSum`, coefficients w / w_first) and its bytes stay
in the push store (`syncer.payloads`), read back only to take out a superseded fold, to
correct a capped share when the round closes (the sums are rescaled to the final shares at
once, and a capped or held-back push is folded again by the difference), or to rebuild the
rounds after a restart. An open round costs one fragment-sized buffer; the merged values are
written into it, so the previous version stays intact for pulls still reading it.

Anchoring: a push anchored at the current version is used as is. A push anchored at an older
version b carries Δ = Θ_p^(b) − θ_m. With `stale_anchor="syncer"` (Decoupled DiLoCo, App. D.2)
the syncer recovers θ_m = Θ_p^(b) − Δ from its short version history and uses Θ_p − θ_m, which
pulls the global value toward the stale learner's parameters; with `"learner"` it uses Δ as is
(Async Local-SGD: the stale learner's own progress is applied to the current value).

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
(`syncer.admission`); merges weight pushes by token-weight shares capped at
`max_weight_share`; and a merge's result is checked finite and within its step bound before it
is installed. A merge that fails the check is refused: its pushes are dropped (counted per
learner, logged), the version does not move, the outer momentum starts again, and the log gets
a record of the refusal but no values.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from decoupled_diloco.config import ExperimentConfig, overlap_steps
from decoupled_diloco.core import accumulate, host, outer
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.syncer import admission, view
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

# Folded token weights span at most this ratio (`SyncerState._fold`); float32 then keeps every
# share apart to ~1e-4 of the smallest.
_WEIGHT_RANGE = 1e3


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
        self.fragments, self._steps = [], []
        for p, (specs, values) in enumerate(zip(fragments, initial, strict=True)):
            for x in specs:
                if np.dtype(x.dtype) != np.float32:
                    raise ValueError(
                        f"fragment {p}: tensor {x.name} is {x.dtype}; the syncer keeps the global "
                        "model in float32 (master weights): give the task float32 parameters "
                        "(model.param_dtype) and compute in another dtype if wanted"
                    )
            size = sum(math.prod(x.shape) for x in specs) if p in self.owned else 0
            step = accumulate.FlatStep(self.tx, max(size, 1))
            flat = host.aligned_zeros(size)
            if size:
                np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in values], out=flat)
            self._steps.append(step)
            self.fragments.append(FragmentState(list(specs), flat, step.init() if size else []))
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
        self.ema_step, self.ema_quorum, self.ema_sync = (Ema(d.ema_decay) for _ in range(3))
        self.merge_log: list[dict[str, Any]] = []
        # How many learners each merge combined: index k counts merges of k outer gradients.
        self.merge_sizes = [0] * (config.num_learners + 1)
        self.seen: dict[tuple[int, int, int], PushResult] = {}
        self.lock = threading.Condition()
        self.store: Any = None  # `syncer.payloads.PushStore` of the pushes in open rounds
        mean_only = is_mean_only or (lambda name: False)
        averaged = is_averaged or (lambda name: False)
        # Per fragment, per tensor: state (batch statistics) rather than a parameter; and the
        # tensors merged by the weighted mean rather than RDA.
        self._averaged = [[bool(averaged(s.name)) for s in specs] for specs in fragments]
        rda = config.outer.merge == "rda"
        self._plain = [
            [not rda or bool(mean_only(s.name)) or bool(averaged(s.name)) for s in specs]
            for specs in fragments
        ]
        for p, frag in enumerate(self.fragments):
            if p in self.owned:
                frag.history[0] = self._kept(p, frag.values)

    def warm_up(self) -> None:
        """Compiles every fragment's outer step now, so the first real round is not slow."""
        for p in sorted(self.owned):
            self._steps[p].warm_up()

    def _kept(self, p: int, values: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """What the version history keeps of fragment p's values (see `FragmentState`)."""
        by_syncer = self.config.decoupled.stale_anchor == "syncer"
        return {t: v for t, v in enumerate(values) if by_syncer or self._averaged[p][t]}

    # Learners --------------------------------------------------------------------------------

    def live_learners(self, now: float) -> list[int]:
        """Learners still training whose last message is within `learner_timeout_s`."""
        timeout = self.config.decoupled.syncer.learner_timeout_s
        return [
            i
            for i, info in self.learners.items()
            if info.state != "done" and now - info.last_seen <= timeout
        ]

    def fastest_step_time(self) -> float:
        """The shortest recent step time among live learners (0 when none reported yet).

        Each learner's is the larger of what it claims and half the pace the syncer saw in its
        heartbeats (`_pace`): a learner that claims tiny steps cannot shrink every other
        learner's H (DyLU) more than twofold below what it really does.
        """
        with self.lock:
            live = self.live_learners(self.clock())
            times = [_step_time(self.learners[i]) for i in live]
            return min((t for t in times if t > 0), default=0.0)

    def register(self, learner_id: int, mesh: str) -> tuple[list[int], int]:
        """Registers (or re-registers) a learner; returns the fragment versions, its incarnation."""
        with self.lock:
            info = self.learners.setdefault(learner_id, LearnerInfo())
            info.mesh, info.state, info.last_seen = mesh, "training", self.clock()
            info.pace_from, info.seen_step_s = None, 0.0  # a restart's pace starts again
            info.incarnation += 1
            # A (re)registration is a new incarnation that numbers its rounds from 0 again:
            # forget the old one's idempotency keys, or its first pushes would look like retries.
            self.seen = {k: v for k, v in self.seen.items() if k[0] != learner_id}
            self._changed("register", learner_id)  # a restart must not resurrect old keys
            return self.versions(), info.incarnation

    def heartbeat(self, learner_id: int, **fields: Any) -> list[int]:
        """Records a learner's progress; returns the fragment versions."""
        with self.lock:
            info = self.learners.setdefault(learner_id, LearnerInfo())
            for name, value in fields.items():
                setattr(info, name, value)
            info.last_seen = self.clock()
            _pace(info, info.last_seen)
            if info.step_time_s > 0:
                self.ema_step.update(_step_time(info))
            self.lock.notify_all()  # a learner that finished may complete a quorum
            return self.versions()

    def versions(self) -> list[int]:
        """Every fragment's published version (what learners may hold); call under the lock."""
        return [f.published for f in self.fragments]

    def publish(self, seq: int, versions: dict[int, tuple[int, list[np.ndarray]]]) -> None:
        """Marks change `seq` durable and makes the given (version, values) visible.

        Called by the committer once a checkpoint holding them is on disk; versions only move
        forward.
        """
        with self.lock:
            if self.wal_failed and seq >= self.wal_failed_seq:
                return  # it holds a change the log does not
            for p, (version, values) in versions.items():
                frag = self.fragments[p]
                if version > frag.published:
                    frag.published, frag.published_values = version, values
                    frag.closed_t = self.clock()  # visible now: ξ_sync counts from here
            self.committed_seq = max(self.committed_seq, seq)
            self.lock.notify_all()

    def wait_committed(self, seq: int, timeout_s: float) -> bool:
        """Blocks until change `seq` is durable (at once when not `durable`); False on timeout."""
        deadline = self.clock() + timeout_s
        with self.lock:
            while self.durable and self.committed_seq < seq:
                left = deadline - self.clock()
                if left <= 0 or (self.wal_failed and seq >= self.wal_failed_seq):
                    return False
                self.lock.wait(min(left, 0.05))
            return True

    # Pushes and rounds -----------------------------------------------------------------------

    def push(self, push: Push) -> PushResult:
        """Handles one validated push under the idempotency and late-push rules (module doc).

        Raises:
          PushRefused: a push of an older incarnation of its learner, or one whose counters,
            added to the learner's pending push of the fragment, pass `train_steps`.
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
            if staleness > self.config.decoupled.syncer.max_staleness:
                frag.late += 1
                result = PushResult(False, reason="late", version=frag.version)
            else:
                previous = frag.pending.get(push.learner_id)
                if previous is not None and previous.steps + push.steps > self.config.train_steps:
                    raise PushRefused(
                        f"steps={push.steps} on top of the pending {previous.steps} pass "
                        f"train_steps={self.config.train_steps}"
                    )
                try:
                    self._add(frag, push)
                except Exception as error:  # noqa: BLE001 - a half-done fold: drop the round
                    pushes = [frag.pending[i] for i in sorted(frag.pending)]
                    self._refuse_merge(
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
            self._changed("push", key, push)
            self._maybe_close(push.fragment)
            self.lock.notify_all()
            return result

    def _add(self, frag: FragmentState, push: Push) -> None:
        """Folds an accepted push into its fragment's open round (superseding its earlier one)."""
        payload = push.delta
        if not isinstance(payload, Payload):
            payload = Payload.of_arrays(frag.specs, payload)
        parts = [(push.base_version, payload)]
        steps, tokens = push.steps, push.tokens
        previous = frag.pending.pop(push.learner_id, None)
        if previous is not None:  # A newer push from the same learner supersedes the older one.
            self._unfold(push.fragment, previous)
            steps, tokens = steps + previous.steps, tokens + previous.tokens
            if self.config.decoupled.stale_anchor == "learner" and (
                previous.base_version != push.base_version
            ):
                # Anchored at different versions, the two outer gradients hold disjoint
                # progress (the learner was overwritten in between): keep both (state: the
                # newer values alone).
                parts = previous.parts + parts
            else:
                self._release(previous.parts)
        pending = Pending(
            push.learner_id,
            push.round,
            push.base_version,
            steps,
            tokens,
            push.incarnation,
            parts,
            outer.token_weight(tokens, steps),
        )
        self._fold(push.fragment, pending)
        # From here on it is read back from its stored copy (if any), not the caller's buffer.
        pending.parts = [(b, x.stored()) for b, x in pending.parts]
        frag.pending[push.learner_id] = pending
        now = self.clock()
        if frag.first_push_t is None:
            frag.first_push_t = now

    def pending_gradient(self, p: int, learner_id: int) -> list[np.ndarray]:
        """A pending push's outer gradient as the merge will take it (re-anchored), per tensor."""
        with self.lock:
            frag = self.fragments[p]
            parts = frag.pending[learner_id].parts
            return [
                x.reshape(s.shape) for x, s in zip(self._tensors(p, parts), frag.specs, strict=True)
            ]

    def _tensors(self, p: int, parts: Sequence[tuple[int, Payload]]) -> Iterator[np.ndarray]:
        """A pending push's outer gradient at the current version, one tensor at a time.

        Anchoring (module doc): a part anchored at an older version b is re-anchored at the
        current Θ, Θ − (Θ^(b) − Δ), with `stale_anchor="syncer"`, and always for state
        (batch statistics), where a stale Δ would carry the versions in between as drift. A
        base the history lacks (only after a restart fell back past an unreadable checkpoint)
        is taken as current. Parts add up; for state the newest alone counts.
        """
        frag = self.fragments[p]
        by_syncer = self.config.decoupled.stale_anchor == "syncer"
        streams = [payload.tensors() for _, payload in parts]
        for t, xs in enumerate(zip(*streams, strict=True)):
            is_state = self._averaged[p][t]
            total = None
            for (base, _), x in zip(parts, xs, strict=True):
                x = np.asarray(x, np.float32)
                if base != frag.version and (by_syncer or is_state):
                    old = frag.history.get(base, {}).get(t, frag.values[t])
                    x = frag.values[t] - (old - x)
                total = x if total is None or is_state else total + x
            yield total

    def _fold(self, p: int, pending: Pending) -> None:
        """Folds a pending push into the round's sums, or holds it back (coefficient 0).

        A push whose weight would widen the folded weights' range past `_WEIGHT_RANGE` is held
        back: folded next to much larger (or smaller) ones, float32 could not take its share
        apart again when the round closes (a capped share is a correction to its fold).
        """
        frag = self.fragments[p]
        if frag.round is None:
            frag.round = accumulate.RoundSum(
                [math.prod(s.shape) for s in frag.specs], self._plain[p]
            )
            frag.first_weight = pending.weight
        folded = [x.coef for x in frag.pending.values() if x.coef > 0]
        coef = pending.weight / frag.first_weight
        if folded and max(*folded, coef) > _WEIGHT_RANGE * min(*folded, coef):
            pending.coef = 0.0
            return
        frag.round.fold(self._tensors(p, pending.parts), coef)
        pending.coef = coef

    def _unfold(self, p: int, pending: Pending) -> None:
        """Takes a superseded push's fold out of the round's sums again."""
        frag = self.fragments[p]
        if pending.coef > 0:
            frag.round.fold(self._tensors(p, pending.parts), -pending.coef)

    def _release(self, parts: Sequence[tuple[int, Payload]]) -> None:
        """Stored payloads that no pending push refers to any more (see `PushStore.release`)."""
        if self.store is not None:
            for _, payload in parts:
                self.store.release(payload.path, self.seq + 1)

    def _maybe_close(self, p: int) -> None:
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
            self._merge(p)

    def tick(self) -> None:
        """Closes every round whose grace window has passed (call periodically)."""
        with self.lock:
            for p in range(len(self.fragments)):
                self._maybe_close(p)

    def next_deadline(self) -> float | None:
        """The earliest time a round may close by its grace window, if any is waiting."""
        with self.lock:
            times = [f.quorum_t + f.grace_s for f in self.fragments if f.quorum_t is not None]
            return min(times) if times else None

    def _merge(self, p: int) -> None:
        """Closes fragment p's round (see `_close`); a close that fails drops the round.

        The round's sums are changed in place as it closes, so a failure half-way (a push file
        that cannot be read back, memory) cannot be retried: its pushes are dropped as a refused
        merge's are (logged by learner), and the fragment stays as it was.
        """
        try:
            self._close(p)
        except Exception as error:  # noqa: BLE001 - any failure: the same consistent way out
            frag = self.fragments[p]
            pushes = [frag.pending[i] for i in sorted(frag.pending)]
            self._refuse_merge(p, pushes, f"the merge failed: {type(error).__name__}: {error}")

    def _close(self, p: int) -> None:
        """Closes fragment p's round: the shares, the merged outer gradient, the outer step."""
        t0 = time.perf_counter()
        frag = self.fragments[p]
        pushes = [frag.pending[i] for i in sorted(frag.pending)]
        raw = [x.weight for x in pushes]
        shares, factor = outer.shares_and_factor(raw, self.config.decoupled.syncer.max_weight_share)
        # The sums hold coef_m = w_m / w_first of every folded push; scaled by c·w_first they
        # hold c·w_m, each uncapped push's share. Capped and held-back pushes are corrected to
        # their shares with their outer gradients read back.
        prescale = factor * frag.first_weight
        corrections = []
        for x, share in zip(pushes, shares, strict=True):
            have = factor * x.weight if x.coef > 0 else 0.0
            if abs(share - have) > 1e-9 * max(share, have):
                corrections.append((x, share - have))
        if corrections:  # (else the rescaling is done by `finish`, in its pass)
            frag.round.scale(prescale)
            prescale = 1.0
        for x, coef in corrections:
            frag.round.fold(self._tensors(p, x.parts), coef)
        # "share": a merge of k of the M learners moves the fragment k/M of the way a merge of
        # all would, so one outer lr suits both gathered rounds and lone asynchronous pushes.
        m = self.config.num_learners
        share = self.config.decoupled.partial_merge == "share"
        merged = frag.round.finish(len(pushes) / m if share else 1.0, prescale)
        buffer = frag.round.buffer
        # Averaged state (batch statistics) is the weighted mean itself: Θ − mean(Θ − θ_m).
        state = {
            t: frag.values[t].reshape(-1) - merged[t]
            for t, is_state in enumerate(self._averaged[p])
            if is_state
        }
        opt_state = self._steps[p](frag.flat, frag.opt_state, buffer, buffer)  # Θ' → buffer
        for t, value in state.items():
            merged[t][:] = value
        new_values = [x.reshape(s.shape) for x, s in zip(merged, frag.specs, strict=True)]
        o, s = self.config.outer, self.config.decoupled.syncer
        # Averaged state (batch statistics) moves by the mean itself: rate 1, no momentum.
        lr = max(o.lr, 1.0 - o.momentum) if any(self._averaged[p]) else o.lr
        bound = admission.merged_step_bound(frag.values, s.max_delta_norm, lr, o.momentum)
        error = admission.check_merged(frag.values, new_values, bound)
        if error:
            self._refuse_merge(p, pushes, error)
            return
        frag.opt_state = opt_state
        if self.merge_hook is not None:
            self.merge_hook()
        frag.set_flat(buffer)
        frag.round = None
        frag.version += 1
        if not self.durable:  # else the committer publishes it once it is on disk
            frag.published, frag.published_values = frag.version, frag.values
        frag.merges += 1
        self.merge_sizes[len(pushes)] += 1
        kept = self._kept(p, frag.values)
        if kept:
            frag.history[frag.version] = kept
        frag.awaiting_sync[frag.version] = {x.learner_id for x in pushes}
        oldest = frag.version - self.config.decoupled.syncer.max_staleness
        frag.history = {v: x for v, x in frag.history.items() if v >= oldest}
        frag.awaiting_sync = {v: x for v, x in frag.awaiting_sync.items() if v >= oldest}
        now = self.clock()
        self.merge_log.append(
            {
                "fragment": p,
                "version": frag.version,
                "learners": [x.learner_id for x in pushes],
                "steps": [x.steps for x in pushes],
                "tokens": [x.tokens for x in pushes],
                "weights": raw,
                "shares": shares,
                "grace_s": frag.grace_s,
                "waited_s": now - frag.first_push_t,
                # (a replayed merge has no quorum time)
                "quorum_wait_s": (now if frag.quorum_t is None else frag.quorum_t)
                - frag.first_push_t,
                "ema_step_s": self.ema_step.get(),
                "ema_quorum_s": self.ema_quorum.get(),
                "ema_sync_s": self.ema_sync.get(),
                "merge_s": time.perf_counter() - t0,
            }
        )
        frag.pending, frag.first_push_t, frag.quorum_t, frag.closed_t = {}, None, None, now
        for x in pushes:
            self._release(x.parts)
        self._changed("merge", p)

    def _refuse_merge(self, p: int, pushes: list[Pending], error: str) -> None:
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
        frag.pending, frag.first_push_t, frag.quorum_t, frag.round = {}, None, None, None
        # The momentum may carry the same harm (it built up towards this round): start it
        # again, so that the fragment's next honest rounds can merge.
        frag.opt_state = self._steps[p].init()
        for x in pushes:
            self._release(x.parts)
        self._changed("refuse", p)  # a restart must not bring the dropped pushes back

    def _changed(self, kind: str, *args: Any) -> None:
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

    # Pulls and status ------------------------------------------------------------------------

    def wait_for(
        self,
        p: int,
        min_version: int,
        timeout_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> tuple[int, list[np.ndarray]]:
        """Blocks until fragment p reaches `min_version` (or the timeout); returns its value.

        `alive` (the call still open) is checked while it waits: a caller that gave up does not
        keep a thread.
        """
        deadline = self.clock() + timeout_s
        with self.lock:
            frag = self.fragments[p]
            while frag.published < min_version:
                left = deadline - self.clock()
                if left <= 0 or not alive():
                    return -1, []
                self.lock.wait(min(left, 0.05))
                self._maybe_close(p)
            return frag.published, frag.published_values

    def record_sync_time(self, p: int, version: int, learner_id: int) -> None:
        """After a pull delivered `version`: time since its round closed (ξ_sync).

        Counted once per learner whose push that merge holds: a learner that pulls a version
        merged without it (catching up, or the evaluator) did not wait for it, and the time
        since that close would inflate ξ_sync and shrink every later grace window to nothing.
        """
        with self.lock:
            frag = self.fragments[p]
            waiting = frag.awaiting_sync.get(version, set())
            if frag.published == version and frag.closed_t is not None and learner_id in waiting:
                waiting.discard(learner_id)
                self.ema_sync.update(self.clock() - frag.closed_t)

    def status(self) -> dict[str, Any]:
        """Learners (progress, heartbeat age, staleness), fragments (versions, merges), EMAs."""
        return view.status(self)


# A learner's pace as the syncer sees it is measured over windows of at least this long.
PACE_WINDOW_S = 10.0


def _pace(info: LearnerInfo, now: float) -> None:
    """Updates the wall time per step the syncer saw of a learner, over its heartbeats."""
    if info.pace_from is None or info.step < info.pace_from[0]:
        info.pace_from = (info.step, now)
        return
    step0, t0 = info.pace_from
    if now - t0 >= PACE_WINDOW_S and info.step > step0:
        info.seen_step_s = (now - t0) / (info.step - step0)
        info.pace_from = (info.step, now)


def _step_time(info: LearnerInfo) -> float:
    """A learner's step time for DyLU: its claim, floored at half the pace the syncer saw."""
    return max(info.step_time_s, info.seen_step_s / 2) if info.step_time_s > 0 else 0.0
