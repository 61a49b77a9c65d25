"""A learner's background link to the syncer: registration, each fragment's push and pull.

`Learner` runs the step loop; when fragment p is due it hands Δ = anchor_p − θ_p (or its encoded
sections) to `SyncerLink._sync` on a worker thread, which pushes it (retrying through an outage,
see `learner_recovery.Outbox`), waits for the merge that holds the push, and leaves the merged
values in the inbox as an `Inbound` for the step boundary where the loop applies them.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import numpy as np

from decoupled_diloco.comm import wire
from decoupled_diloco.core import fragments as F
from decoupled_diloco.learner import recovery


@dataclasses.dataclass
class Encoded:
    """A fragment's encoded outer gradient: section arrays in wire order."""

    arrays: list[np.ndarray]


@dataclasses.dataclass
class Inbound:
    """A merged fragment waiting for its step boundary."""

    version: int
    values: list[np.ndarray]
    apply_after_step: int
    pushed_at: int = -1  # the step of the push this merge answers (-1: unknown)


class SyncerLink:
    """The syncer calls of a `Learner` (a mixin: `Learner.__init__` sets the state they share).

    Uses: `config`, `id`, `cut`, `specs`, `codec`, `client` (`comm.shards.syncer_client`),
    `outbox`, `stop`, per-fragment `anchor`, `versions` and `rounds`, the inbox (`inbox`,
    `inbox_lock`) that the step loop drains, and the counters a heartbeat reports; records
    `pushes`, `round_log` and `errors`.
    """

    def connect(self, timeout_s: float = 120.0, peers_s: float = 60.0) -> None:
        """Waits for the syncer, registers, and takes the current global fragments.

        In a fresh run (every fragment still at version 0) it also waits up to `peers_s` for
        all learners to register, so that they start together and their pushes of a round
        arrive close enough for the grace window to merge them. A learner joining a run in
        progress never waits.
        """
        self.client.wait_ready(timeout_s)
        reply = self.client.register(self.id, F.fingerprint(self.specs), self.mesh_name)
        self._mark("waiting")  # for peers (fresh run), then the global fragments
        deadline = time.monotonic() + peers_s
        while not any(reply.versions) and time.monotonic() < deadline:
            if len(self.client.status()["learners"]) >= self.config.num_learners:
                break
            time.sleep(0.05)
        for p in range(len(self.cut)):
            version, values = self.client.pull(
                self.id, p, 0, self.config.decoupled.syncer.rpc_timeout_s
            )
            self.anchor[p], self.versions[p] = values, version

    def _sync(
        self,
        p: int,
        rnd: int,
        base: int,
        anchor: list,
        local: list,
        steps: int,
        tokens: int,
        final: bool,
        pushed_at: int,
        ticket: recovery.Unsent | None = None,
    ) -> None:
        """Background: push Δ = anchor − θ for fragment p, then wait for the merged fragment.

        The merged fragment is due at the step boundary after step `pushed_at` + τ, or at the
        first boundary after it arrives if it comes later. While the syncer is unreachable,
        the push and the pull are retried with backoff (`ticket`: see `recovery.Outbox`).
        """
        try:
            if isinstance(local, Encoded):  # compressed on the mesh by `_launch`
                arrays, tensors = local.arrays, wire.headers(self.cut[p], self.codec)
            else:
                arrays, tensors = [a - x for a, x in zip(anchor, local, strict=True)], None
            send = functools.partial(
                self.client.push,
                learner_id=self.id,
                fragment=p,
                round=rnd,
                base_version=base,
                steps=steps,
                tokens=tokens,
                specs=self.cut[p],
                arrays=arrays,
                tensors=tensors,
            )
            reply = self.outbox.deliver(ticket, send, self.stop) if ticket else send()
            if reply is None:  # folded into a newer push, dropped, or the learner is stopping
                return
            sent, received = self.client.last_bytes(), 0
            self.pushes[
                "duplicate" if reply.duplicate else "accepted" if reply.accepted else "late"
            ] += 1
            if final:
                return
            # Short waits, so that a learner shutting down is never held by a pending pull.
            wait_s = min(self.config.decoupled.syncer.rpc_timeout_s, 5.0)
            # An accepted push waits in the fragment's open round, which the next merge closes:
            # wait for that merge (it holds this push), not for any version newer than `base`
            # (a merge of other learners' pushes that closed while this one was on its way).
            want = max(base, reply.version) + 1 if reply.accepted else base + 1
            version = -1
            # A newer push of p takes over the wait (one waiting pull per fragment): that merge
            # may be long in coming (this push folded into a newer one, or lost with a
            # restarted syncer's unsaved state), and the newer pull brings what is there.
            while version < 0 and not self.stop.is_set() and self.rounds[p] == rnd + 1:
                # `have`: with a compressed downlink the syncer sends the difference from it.
                pull = functools.partial(
                    self.client.pull, self.id, p, want, wait_s, have=(base, anchor)
                )
                pulled = recovery.retrying(pull, self.stop)  # the syncer may be restarting
                if pulled is None:
                    break
                version, values = pulled
                received += self.client.last_bytes()
            self.round_log.append(
                {"fragment": p, "round": rnd, "step": pushed_at, "sent": sent, "received": received}
            )
            if version >= 0:
                with self.inbox_lock:
                    held = self.inbox.get(p)
                    # The same version may answer two pushes (the newer one superseded the
                    # older in the syncer's open round): it answers the newer one.
                    if held is None or (held.version, held.pushed_at) < (version, pushed_at):
                        d = self.config.decoupled
                        after = pushed_at + (0 if d.apply_on_arrival else d.overlap_steps)
                        self.inbox[p] = Inbound(version, values, after, pushed_at)
        except Exception as error:  # noqa: BLE001 - the step loop must go on; report it.
            if self.stop.is_set():  # gave up at the end: counted in `pushes_unsent`
                return
            self.errors.append(f"fragment {p} round {rnd}: {type(error).__name__}: {error}")
            print(f"[learner {self.id}] sync error: {self.errors[-1]}", file=sys.stderr, flush=True)

    def _heartbeats(self) -> None:
        while not self.stop.wait(self.config.decoupled.syncer.heartbeat_s):
            self._heartbeat("training")

    def _heartbeat(self, state: str) -> None:
        try:
            reply = self.client.heartbeat(
                learner_id=self.id,
                step=self.step,
                tokens=self.tokens,
                loss=float(self.loss),
                state=state,
                versions=self.versions,
                blocked_s=self.blocked_s,
                step_time_s=self.step_time_s,
                eval_loss=self.eval_loss,
                bytes_sent=self.client.bytes_sent,
                bytes_received=self.client.bytes_received,
                sync_rounds=len(self.round_log),
            )
            self.fastest_step_s = reply.fastest_step_time_s
        except Exception as error:  # noqa: BLE001 - a missed heartbeat is not fatal.
            print(f"[learner {self.id}] heartbeat failed: {error}", file=sys.stderr, flush=True)
