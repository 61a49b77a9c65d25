"""Pushes that survive outages: undelivered pushes per fragment, folded and bounded.

Outages: a push that cannot be delivered (the syncer or its shard is down) is retried with
jittered exponential backoff (capped at 5 s) while the learner keeps stepping. Undelivered
pushes are bounded per fragment: a newer push of the same fragment anchored at the same
version carries the older one's progress (Δ = anchor − θ covers every step since the anchor),
so an uncompressed older push that is not mid-attempt is folded into it and never sent again
(sending both would apply its progress twice). Its step and token counts go with the newer
push only if it was never attempted: an attempt whose reply was lost may have reached the
syncer, which then holds its counts already, and a newer push at the same anchor adds its own
counts to them there. Compressed pushes (whose error feedback already counted them as
sent) and pushes anchored at different versions are kept, at most `syncer.max_unsent` per
fragment waiting between attempts (plus those mid-attempt, at most one per sender thread);
past the bound the oldest waiting one is dropped, logged and counted (`pushes_dropped`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from decoupled_diloco.comm.retry import retry

T = TypeVar("T")


class _Settled(Exception):
    """The push was folded into a newer one or dropped: nothing left to send."""


@dataclasses.dataclass(eq=False)
class Unsent:
    """An undelivered push of one fragment (its payload stays with its sender)."""

    fragment: int
    base: int
    steps: int
    tokens: int
    foldable: bool  # an uncompressed outer gradient: a newer one at the same base contains it
    data: list[list[int]] = dataclasses.field(default_factory=list)  # leased batches it holds
    attempting: bool = False
    tried: bool = False  # an attempt was made: the syncer may hold it (and its counts)
    superseded: bool = False
    dropped: bool = False


class Outbox:
    """Undelivered pushes per fragment, bounded (see the module doc).

    Args:
      num_fragments: P.
      bound: undelivered pushes kept per fragment before the oldest is dropped.
      name: for log lines.
    """

    def __init__(self, num_fragments: int, bound: int, name: str = "learner"):
        self.bound, self.name = bound, name
        self.lock = threading.Lock()
        self.pending: list[list[Unsent]] = [[] for _ in range(num_fragments)]
        self.folded = self.dropped = 0

    def add(
        self,
        p: int,
        base: int,
        steps: int,
        tokens: int,
        foldable: bool,
        data: list[list[int]] | None = None,
    ) -> Unsent:
        """Registers a new push of fragment p; folds or drops older undelivered ones.

        `data`: the leased batches ([lease, begin, end)) it trained on; they go with its
        counts when an older push is folded into it.
        """
        ticket = Unsent(p, base, steps, tokens, foldable, list(data or ()))
        with self.lock:
            for older in self.pending[p]:
                if foldable and older.foldable and older.base == base and not older.attempting:
                    older.superseded = True
                    if not older.tried:  # else the syncer may count them already
                        ticket.steps += older.steps
                        ticket.tokens += older.tokens
                        ticket.data = older.data + ticket.data
                    self.folded += 1
            self.pending[p] = [x for x in self.pending[p] if not x.superseded]
            # Only pushes waiting between attempts count (one mid-attempt may be delivered).
            while len(waiting := [x for x in self.pending[p] if not x.attempting]) >= self.bound:
                oldest = waiting[0]
                self.pending[p] = [x for x in self.pending[p] if x is not oldest]
                oldest.dropped = True
                self.dropped += 1
                print(
                    f"[{self.name}] fragment {p}: {self.bound} pushes undelivered; dropped the "
                    f"oldest ({oldest.steps} steps anchored at version {oldest.base})",
                    file=sys.stderr,
                    flush=True,
                )
            self.pending[p].append(ticket)
        return ticket

    def unsent(self) -> int:
        """Pushes not delivered yet."""
        with self.lock:
            return sum(len(x) for x in self.pending)

    def deliver(
        self,
        ticket: Unsent,
        send: Callable[[], T],
        stop: threading.Event,
        on_retry: Callable[[], None] | None = None,
    ) -> T | None:
        """Calls `send` until it succeeds, retrying while the syncer is unreachable (`comm.retry`).

        Returns:
          The reply, or None when the push was folded into a newer one, dropped, or `stop`
          was set first (the learner is shutting down).

        Raises:
          grpc.RpcError: a refusal that no retry can fix.
        """

        def attempt() -> T:
            with self.lock:
                if ticket.superseded or ticket.dropped:
                    raise _Settled
                ticket.attempting = ticket.tried = True
            try:
                return send()
            finally:
                with self.lock:
                    ticket.attempting = False

        try:
            return retry(attempt, stop=stop, on_retry=on_retry)
        except _Settled:
            return None
        finally:
            with self.lock:
                p = ticket.fragment
                self.pending[p] = [x for x in self.pending[p] if x is not ticket]
