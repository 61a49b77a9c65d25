"""What a link reports of its progress: its counters, and the heartbeats that send them.

`SyncCounters` is the link's progress and traffic accounting, written by the step loop and by
the round trips' worker threads. `Heartbeats` sends them: its thread starts at registration
(`DecoupledSync.connect`) and sends one heartbeat every `decoupled.syncer.heartbeat_s` until
the link's `stop` is set; `DecoupledSync.close` then sends a last one, state "done". Only a
process that talks to the syncer sends (`HostBridge.talks`: a multi-process island's leader).
A heartbeat reports the step, tokens, loss, fragment versions, stall and traffic (the syncer's
status and metrics); the reply carries the fastest live learner's step time, which DyLU's
schedule reads, the phase of a learner ahead, and how many learners train now (`live`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

from decoupled_diloco.learner.schedule import Schedule


@dataclasses.dataclass
class SyncCounters:
    """A link's progress, time and push accounting (its summary and metrics read them)."""

    step: int = 0  # inner steps done
    tokens: int = 0
    loss: Any = float("nan")  # the last step's (a device scalar is fine)
    eval_loss: float = float("nan")  # learners do not evaluate; the launcher evaluates Θ
    blocked_s: float = 0.0  # the step loop waiting for merges (`wait_for_merge`)
    sync_host_s: float = 0.0  # device<->host copies and merging back
    compress_s: float = 0.0  # encoding on the mesh
    retries: int = 0  # this link's own retries of pushes and pulls (the client adds its)
    pushes: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"accepted": 0, "late": 0, "duplicate": 0, "covered": 0}
    )
    # Pushes held because the fragment's last round trip had not ended (a link behind).
    deferred: int = 0
    # Pushes refused as late whose steps and data went with a later push (`FragmentState.rebase`).
    rebased: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    round_log: list[dict[str, int]] = dataclasses.field(default_factory=list)  # bytes per push
    # Per applied merge: the push it answers and the step it was applied after (the lag is
    # how many steps trained away from the merged value).
    applied: list[dict[str, int]] = dataclasses.field(default_factory=list)

    def retried(self) -> None:
        """One retry of a push or pull (a round trip's `on_retry`)."""
        self.retries += 1


class Heartbeats:
    """The heartbeat thread of one link, and the heartbeat it sends.

    Args:
      client: the syncer client.
      learner_id: whose heartbeats.
      counters: what they report.
      schedule: the push schedule (reports its step time; hears the fastest and the lead).
      versions: the fragments' versions now.
      interval_s: seconds between heartbeats.
      stop: set when the link stops (the thread ends).
      talks: whether this process sends them (a multi-process island: its leader only).
    """

    def __init__(
        self,
        client: Any,
        learner_id: int,
        counters: SyncCounters,
        schedule: Schedule,
        versions: Callable[[], list[int]],
        interval_s: float,
        stop: threading.Event,
        talks: bool = True,
    ):
        self.client, self.id, self.counters, self.schedule = client, learner_id, counters, schedule
        self.versions, self.interval_s, self.stop, self.talks = versions, interval_s, stop, talks
        # Learners training now, as the syncer last said (heartbeat and lease replies; 0: not
        # heard yet): a constant global batch is split by it (`config.units_per_step`).
        self.live = 0
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
        """Waits for the thread to end (it ends once `stop` is set)."""
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.send("training")

    def send(self, state: str) -> None:
        """Sends one heartbeat in `state` ("training", "done"); a failure is logged, not raised."""
        if not self.talks:
            return
        c = self.counters
        try:
            reply = self.client.heartbeat(
                learner_id=self.id,
                step=c.step,
                tokens=c.tokens,
                loss=float(c.loss),
                state=state,
                versions=self.versions(),
                blocked_s=c.blocked_s,
                step_time_s=self.schedule.step_time_s,
                eval_loss=c.eval_loss,
                bytes_sent=self.client.bytes_sent,
                bytes_received=self.client.bytes_received,
                sync_rounds=len(c.round_log),
                phase_step=c.step + self.schedule.shift,
            )
            self.schedule.fastest_step_s = reply.fastest_step_time_s
            self.live = reply.live_learners or self.live
            if reply.HasField("lead_step"):  # (a syncer that does not say: never aligned)
                self.schedule.hear_lead(reply.lead_step, reply.lead_step_time_s)
        except Exception as error:  # noqa: BLE001 - a missed heartbeat is not fatal.
            print(f"[learner {self.id}] heartbeat failed: {error}", file=sys.stderr, flush=True)
