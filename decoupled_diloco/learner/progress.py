"""What a link reports of its progress: heartbeats to the syncer, and its summary.

`Heartbeats` is owned by a `DecoupledSync`. Its thread starts at registration (`connect`) and
sends one heartbeat through the link's `_heartbeat` hook every `decoupled.syncer.heartbeat_s`
until the link's `stop` is set (a multi-process island overrides the hook: only its leader
sends); `close` then sends a last one, state "done". A heartbeat reports the link's step,
tokens, loss, fragment versions, stall and traffic (the syncer's status and metrics); the reply
carries the fastest live learner's step time, which DyLU's schedule reads. `summary` is the
link's counters for the learner's summary (and its metrics).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decoupled_diloco.learner.link import DecoupledSync


class Heartbeats:
    """The heartbeat thread of one link, and the heartbeat it sends.

    Args:
      link: the link whose progress the heartbeats report (its client, counters and `stop`).
    """

    def __init__(self, link: DecoupledSync):
        self.link = link
        self.thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        """Whether the thread was started (by `start`)."""
        return self.thread is not None

    def start(self) -> None:
        """Starts the heartbeat thread (once)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def join(self) -> None:
        """Waits for the thread to end (it ends once the link's `stop` is set)."""
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        link = self.link
        while not link.stop.wait(link.config.decoupled.syncer.heartbeat_s):
            link._heartbeat("training")

    def send(self, state: str) -> None:
        """Sends one heartbeat in `state` ("training", "done"); a failure is logged, not raised."""
        link = self.link
        try:
            reply = link.client.heartbeat(
                learner_id=link.id,
                step=link.step,
                tokens=link.tokens,
                loss=float(link.loss),
                state=state,
                versions=link.versions,
                blocked_s=link.blocked_s,
                step_time_s=link.schedule.step_time_s,
                eval_loss=link.eval_loss,
                bytes_sent=link.client.bytes_sent,
                bytes_received=link.client.bytes_received,
                sync_rounds=len(link.round_log),
                phase_step=link.step + link.schedule.shift,
            )
            link.schedule.fastest_step_s = reply.fastest_step_time_s
            link.live = reply.live_learners or link.live
            if reply.HasField("lead_step"):  # (a syncer that does not say: never aligned)
                link.schedule.hear_lead(reply.lead_step, reply.lead_step_time_s)
        except Exception as error:  # noqa: BLE001 - a missed heartbeat is not fatal.
            print(f"[learner {link.id}] heartbeat failed: {error}", file=sys.stderr, flush=True)


def summary(link: DecoupledSync) -> dict[str, Any]:
    """The link's counters for the learner's summary (`DecoupledSync.summary`)."""
    return {
        "versions": link.versions,
        "pushes": link.pushes,
        "pushes_folded": link.outbox.folded,
        "pushes_dropped": link.outbox.dropped,
        "pushes_unsent": link.outbox.unsent(),
        # Pushes held because the fragment's last round trip had not ended (a link behind).
        "pushes_deferred": link.deferred,
        # Pushes refused as late whose steps and data went with a later push (`push.rebase`).
        "pushes_rebased": link.rebased,
        "retries": link.client.retries_done + link.retries,
        "errors": link.errors,
        # Traffic of the data calls, headers included (the initial pulls too).
        "bytes_sent": link.client.bytes_sent,
        "bytes_received": link.client.bytes_received,
        "compression": link.encoder.codec.scheme,
        "rounds": link.round_log,
        "applied": link.applied,
    }
