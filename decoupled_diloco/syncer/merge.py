"""One fragment's round arithmetic on the syncer: re-anchoring, folding, shares, the outer step.

`syncer.state` decides when a round closes (quorum, grace, late pushes, idempotency); this
module computes what it merges into. Token weights are w = tokens²/steps; the round's outer
gradient is RDA of the pushes (or the weighted mean for the task's mean-only tensors), the same
merge as `core.outer.outer_round`, computed as the pushes arrive: each push is folded into the
round's sums when it arrives (`core.accumulate.RoundSum`, coefficients w / w_first), so memory
does not grow with the number of learners. A push's bytes stay in the push store
(`syncer.payloads`) and are read back only to take out a superseded fold, to correct a capped
share when the round closes, or to rebuild the rounds after a restart.

Anchoring: a push anchored at the current version is used as is. A push anchored at an older
version b carries Δ = Θ_p^(b) − θ_m. With `stale_anchor="syncer"` (Decoupled DiLoCo, App. D.2)
the syncer recovers θ_m = Θ_p^(b) − Δ from its short version history and uses Θ_p − θ_m, which
pulls the global value toward the stale learner's parameters; with `"learner"` it uses Δ as is
(Async Local-SGD: the stale learner's own progress is applied to the current value).

Defence in depth: shares are capped at `max_weight_share`, and a merge's result is checked
finite and within its step bound (`syncer.admission`) before the state installs it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from decoupled_diloco import runtime
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import accumulate, host, outer
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.syncer import admission
from decoupled_diloco.syncer.payloads import Payload
from decoupled_diloco.syncer.records import FragmentState, Pending, Push

# Folded token weights span at most this ratio (`FragmentMath.fold`); float32 then keeps every
# share apart to ~1e-4 of the smallest.
WEIGHT_RANGE = 1e3


@dataclasses.dataclass
class Merged:
    """A closed round's result, not yet installed.

    Attributes:
      buffer: the new values as one flat vector (read-only: `FlatStep`'s output; installed
        with `FragmentState.install`, which makes the per-tensor views).
      norm: ‖buffer‖ (the next admission bounds' scale, `FragmentState.norm`).
      opt_state: the outer optimizer state after the step (`FlatStep`'s leaves).
      weights: the pushes' raw token weights; `shares` what each counted for after the cap.
    """

    buffer: np.ndarray
    norm: float
    opt_state: list[Any]
    weights: list[float]
    shares: list[float]

    def describe(
        self,
        p: int,
        frag: FragmentState,
        pushes: Sequence[Pending],
        now: float,
        emas: dict[str, float],
        t0: float,
    ) -> dict[str, Any]:
        """The merge log's entry for it, installed as `frag`'s current version at `now`.

        `emas` are the syncer's step, quorum and sync-time estimates; `t0` the
        `time.perf_counter()` when the close began.
        """
        return {
            "fragment": p,
            "version": frag.version,
            "learners": [x.learner_id for x in pushes],
            "steps": [x.steps for x in pushes],
            "tokens": [x.tokens for x in pushes],
            "weights": self.weights,
            "shares": self.shares,
            "grace_s": frag.grace_s,
            "waited_s": now - frag.first_push_t,
            # (a replayed merge has no quorum time)
            "quorum_wait_s": (now if frag.quorum_t is None else frag.quorum_t) - frag.first_push_t,
            **{f"ema_{k}_s": v for k, v in emas.items()},
            "merge_s": time.perf_counter() - t0,
        }


class FragmentMath:
    """The arithmetic of one fragment's rounds (module doc); holds no round state itself.

    Args:
      config: the experiment (outer optimizer, merge, anchoring and share settings).
      tx: the outer optimizer.
      specs: the fragment's tensor specs.
      size: its number of float32 values (0 for a fragment another shard owns).
      averaged: per tensor, synced state (batch statistics) that takes the weighted mean.
      mean_only: per tensor, merged by the weighted mean rather than RDA.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        tx: Any,
        specs: Sequence[TensorSpec],
        size: int,
        averaged: Sequence[bool],
        mean_only: Sequence[bool],
    ):
        self.config, self.specs = config, list(specs)
        self.averaged = list(averaged)
        rda = config.outer.merge == "rda"
        self.plain = [not rda or m or a for m, a in zip(mean_only, averaged, strict=True)]
        self.by_syncer = config.decoupled.stale_anchor == "syncer"
        self.sizes = [math.prod(s.shape) for s in self.specs]
        offsets = np.cumsum([0] + self.sizes)
        ranges = [(int(offsets[t]), int(offsets[t + 1])) for t, a in enumerate(averaged) if a]
        self.step = accumulate.FlatStep(tx, max(size, 1), ranges if size else ())

    def kept(self, values: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """What the version history keeps of the fragment's values (see `FragmentState`)."""
        return {t: v for t, v in enumerate(values) if self.by_syncer or self.averaged[t]}

    def tensors(
        self, frag: FragmentState, parts: Sequence[tuple[int, Payload]]
    ) -> Iterator[np.ndarray]:
        """A pending push's outer gradient at the current version, one tensor at a time.

        Anchoring (module doc): a part anchored at an older version b is re-anchored at the
        current Θ, Θ − (Θ^(b) − Δ), with `stale_anchor="syncer"`, and always for state
        (batch statistics), where a stale Δ would carry the versions in between as drift. A
        base the history lacks (only after a restart fell back past an unreadable checkpoint)
        is taken as current. Parts add up; for state the newest alone counts.
        """
        streams = [payload.tensors() for _, payload in parts]
        for t, xs in enumerate(zip(*streams, strict=True)):
            is_state = self.averaged[t]
            total = None
            for (base, _), x in zip(parts, xs, strict=True):
                x = np.asarray(x, np.float32)
                if base != frag.version and (self.by_syncer or is_state):
                    old = frag.history.get(base, {}).get(t, frag.values[t])
                    x = frag.values[t] - (old - x)
                total = x if total is None or is_state else total + x
            yield total

    def add(
        self,
        frag: FragmentState,
        push: Push,
        release: Callable[[Sequence[tuple[int, Payload]]], None],
    ) -> None:
        """Folds an accepted push into the open round, superseding the learner's earlier one.

        `release` is given the stored parts no pending push refers to any more.
        """
        payload = push.delta
        if not isinstance(payload, Payload):
            payload = Payload.of_arrays(frag.specs, payload)
        parts = [(push.base_version, payload)]
        steps, tokens, data = push.steps, push.tokens, list(push.data)
        previous = frag.pending.pop(push.learner_id, None)
        if previous is not None:  # A newer push from the same learner supersedes the older one.
            self.unfold(frag, previous)
            steps, tokens = steps + previous.steps, tokens + previous.tokens
            data = previous.data + data  # the newer outer gradient holds both's training
            if not self.by_syncer and previous.base_version != push.base_version:
                # Anchored at different versions, the two outer gradients hold disjoint
                # progress (the learner was overwritten in between): keep both (state: the
                # newer values alone).
                parts = previous.parts + parts
            else:
                release(previous.parts)
        pending = Pending(
            push.learner_id,
            push.round,
            push.base_version,
            steps,
            tokens,
            push.incarnation,
            parts,
            outer.token_weight(tokens, steps),
            data=data,
        )
        self.fold(frag, pending)
        # From here on it is read back from its stored copy (if any), not the caller's buffer.
        pending.parts = [(b, x.stored()) for b, x in pending.parts]
        frag.pending[push.learner_id] = pending

    def fold(self, frag: FragmentState, pending: Pending) -> None:
        """Folds a pending push into the round's sums, or holds it back (coefficient 0).

        A push whose weight would widen the folded weights' range past `WEIGHT_RANGE` is held
        back: folded next to much larger (or smaller) ones, float32 could not take its share
        apart again when the round closes (a capped share is a correction to its fold).
        """
        if frag.round is None:
            device, n = self.step.device, sum(self.sizes)
            # (on the host CPU the outer step takes the sums' memory for the new values)
            storage = runtime.xla_host_vector(n, device) if device.platform == "cpu" else None
            frag.round = accumulate.RoundSum(self.sizes, self.plain, storage)
            frag.first_weight = pending.weight
        folded = [x.coef for x in frag.pending.values() if x.coef > 0]
        coef = pending.weight / frag.first_weight
        if folded and max(*folded, coef) > WEIGHT_RANGE * min(*folded, coef):
            pending.coef = 0.0
            return
        frag.round.fold(self.tensors(frag, pending.parts), coef)
        pending.coef = coef

    def unfold(self, frag: FragmentState, pending: Pending) -> None:
        """Takes a superseded push's fold out of the round's sums again."""
        if pending.coef > 0:
            frag.round.fold(self.tensors(frag, pending.parts), -pending.coef)

    def close(self, frag: FragmentState, pushes: Sequence[Pending], live: int) -> Merged | str:
        """The round's shares, merged outer gradient and outer step; or why it is refused.

        `live`: the learners that count as alive now (a "share" merge's k/M takes M from them,
        so that a learner joining or leaving changes the share).

        The round's sums are changed in place (the caller drops the round on an exception).
        Returns the result to install, or the reason the check refused it (nothing changed
        but the round's sums).
        """
        raw = [x.weight for x in pushes]
        d, o = self.config.decoupled, self.config.outer
        shares, factor = outer.shares_and_factor(raw, d.syncer.max_weight_share)
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
            frag.round.fold(self.tensors(frag, x.parts), coef)
        # "share": a merge of k of the M live learners moves the fragment k/M of the way a merge
        # of all would, so one outer lr suits both gathered rounds and lone asynchronous pushes.
        members = max(live, len(pushes))
        fraction = len(pushes) / members if d.partial_merge == "share" else 1.0
        frag.round.finish(fraction, prescale)
        # Θ' in the sums' memory (`RoundSum.take`), never over installed values; averaged
        # state (batch statistics) is the weighted mean itself, Θ − mean(Θ − θ_m) (`FlatStep`'s
        # `averaged`); ‖Θ' − Θ‖² and ‖Θ'‖² from the same pass.
        sums = frag.round.take()
        flat, opt_state, step_sq, flat_sq = self.step(frag.flat, frag.opt_state, sums)
        # Averaged state (batch statistics) moves by the mean itself: rate 1, no momentum.
        lr = max(o.lr, 1.0 - o.momentum) if any(self.averaged) else o.lr
        bound = admission.merged_step_bound(
            frag.norm(), frag.flat.size, d.syncer.max_delta_norm, lr, o.momentum
        )
        error = admission.check_step(step_sq, bound)
        return error or Merged(flat, math.sqrt(flat_sq), opt_state, raw, shares)


def initial_states(
    config: ExperimentConfig,
    tx: Any,
    fragments: Sequence[Sequence[TensorSpec]],
    initial: Iterable[Sequence[np.ndarray]],
    owned: set[int],
    is_mean_only: Callable[[str], bool] | None,
    is_averaged: Callable[[str], bool] | None,
) -> tuple[list[FragmentState], list[FragmentMath]]:
    """Every fragment's state at version 0 and its arithmetic (`SyncerState`'s arguments).

    A fragment not in `owned` keeps its specs but no values (empty placeholders).
    """
    mean_only = is_mean_only or (lambda name: False)
    averaged = is_averaged or (lambda name: False)
    states, rules = [], []
    for p, (specs, values) in enumerate(zip(fragments, initial, strict=True)):
        for x in specs:
            if np.dtype(x.dtype) != np.float32:
                raise ValueError(
                    f"fragment {p}: tensor {x.name} is {x.dtype}; the syncer keeps the global "
                    "model in float32 (master weights): give the task float32 parameters "
                    "(model.param_dtype) and compute in another dtype if wanted"
                )
        size = sum(math.prod(x.shape) for x in specs) if p in owned else 0
        fm = FragmentMath(
            config,
            tx,
            specs,
            size,
            averaged=[bool(averaged(x.name)) for x in specs],
            mean_only=[bool(mean_only(x.name)) for x in specs],
        )
        flat = host.aligned_zeros(size)
        if size:
            np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in values], out=flat)
        frag = FragmentState(list(specs), flat, fm.step.init() if size else [])
        if p in owned:
            frag.history[0] = fm.kept(frag.values)
        states.append(frag)
        rules.append(fm)
    return states, rules
