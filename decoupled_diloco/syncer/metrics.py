"""The syncer's Prometheus metrics, read from its state at each scrape (docs/operations.md).

`SyncerMetrics(server)` is a `prometheus_client` collector: every scrape reads the state once
under its lock (`SyncerState.status`), the service's counters and the committer's, so nothing
in the merge path knows about Prometheus. Merge times and quorum waits become histograms as the
merge log grows. Every sample carries the `shard` label; learner samples the `learner` label.

  registry = prometheus_client.CollectorRegistry()
  registry.register(SyncerMetrics(server))
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

# Seconds: a merge of a tiny model takes ~1 ms, of a 1B one's fragment seconds; a quorum waits
# up to a few outer rounds.
_MERGE_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0)
_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


# The codes the syncer refuses with (`SyncerService._abort`), exposed from 0.
_CODES = (
    "unauthenticated", "permission_denied", "invalid_argument", "resource_exhausted",
    "failed_precondition", "unavailable",
)  # fmt: skip


def _finite(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else math.nan


class SyncerMetrics(Collector):
    """The metrics of one syncer shard (`SyncerServer`)."""

    def __init__(self, server: Any):
        self.state, self.service, self.committer = server.state, server.service, server.committer
        self.shard = str(server.shard)
        self._lock = threading.Lock()  # scrapes may overlap; the merge-log cursor is shared
        # Merges before this collector (a restored state's) are not observed again.
        self._seen_merges = len(server.state.merge_log)
        self._merge_s = prometheus_client.Histogram(
            "dd_syncer_merge_seconds",
            "Time to close a round: shares, merged outer gradient, outer step, checks.",
            ["shard"],
            buckets=_MERGE_BUCKETS,
            registry=None,
        )
        self._quorum_s = prometheus_client.Histogram(
            "dd_syncer_quorum_wait_seconds",
            "Time from a round's first push until quorum was reached.",
            ["shard"],
            buckets=_WAIT_BUCKETS,
            registry=None,
        )
        for histogram in (self._merge_s, self._quorum_s):  # shown (empty) before any merge
            histogram.labels(self.shard)

    def _observe_merges(self) -> None:
        log = self.state.merge_log  # appended under the state lock; read the new tail
        with self._lock:
            if len(log) < self._seen_merges:  # replaced by a restore: start again
                self._seen_merges = 0
            for entry in log[self._seen_merges :]:
                self._merge_s.labels(self.shard).observe(entry.get("merge_s", 0.0))
                self._quorum_s.labels(self.shard).observe(max(entry.get("quorum_wait_s", 0.0), 0))
            self._seen_merges = len(log)

    def collect(self) -> Iterator[Any]:
        """One scrape's samples."""
        status = self.state.status()
        shard = self.shard
        yield from self._fragments(status, shard)
        yield from self._learners(status, shard)
        s = self.service
        refused = CounterMetricFamily(
            "dd_syncer_refused_requests",
            "Calls refused before or by the state, by gRPC status code.",
            labels=["shard", "code"],
        )
        with s.counting_lock:
            codes, traffic = dict(s.refused), dict(s.traffic)
        for code in sorted(set(_CODES) | set(codes)):  # from 0: rate() sees the first one
            refused.add_metric([shard, code], codes.get(code, 0))
        yield refused
        yield _counter(
            "dd_syncer_received_bytes", "Push payload bytes received.", shard, traffic["received"]
        )
        yield _counter("dd_syncer_sent_bytes", "Pull payload bytes sent.", shard, traffic["sent"])
        guard = s.guard.stats()
        yield _gauge(
            "dd_syncer_data_calls", "Pushes and pulls being served.", shard, guard["data_calls"]
        )
        yield _gauge(
            "dd_syncer_inflight_bytes", "Push bytes admitted, not yet stored.", shard,
            guard["bytes_in_flight"],
        )  # fmt: skip
        yield _gauge(
            "dd_syncer_uptime_seconds",
            "Seconds since this process started.",
            shard,
            status["uptime_s"],
        )
        ema = status["ema"]
        for key, name, text in (
            ("step_s", "dd_syncer_step_time_seconds", "EMA of the learners' inner step time."),
            ("quorum_s", "dd_syncer_quorum_time_seconds", "EMA of a round's time to quorum."),
            ("sync_s", "dd_syncer_sync_time_seconds", "EMA of merge-to-pull time (xi_sync)."),
        ):
            yield _gauge(name, text, shard, ema[key])
        yield from self._durability(shard)
        self._observe_merges()
        yield from self._merge_s.collect()
        yield from self._quorum_s.collect()

    def _fragments(self, status: dict[str, Any], shard: str) -> Iterator[Any]:
        owned = [(str(p), f) for p, f in enumerate(status["fragments"]) if f["owned"]]
        families = {
            "version": GaugeMetricFamily(
                "dd_syncer_fragment_version", "Published version of the fragment.",
                labels=["shard", "fragment"],
            ),
            "merges": CounterMetricFamily(
                "dd_syncer_merges", "Rounds merged into a new version.",
                labels=["shard", "fragment"],
            ),
            "refused_merges": CounterMetricFamily(
                "dd_syncer_refused_merges",
                "Rounds whose merge failed its check (non-finite, too large): pushes dropped.",
                labels=["shard", "fragment"],
            ),
            "bytes": GaugeMetricFamily(
                "dd_syncer_fragment_bytes", "The fragment's size (float32 values).",
                labels=["shard", "fragment"],
            ),
            "grace_s": GaugeMetricFamily(
                "dd_syncer_grace_window_seconds",
                "The grace window of the fragment's latest round (Eq. 3).",
                labels=["shard", "fragment"],
            ),
            "pending": GaugeMetricFamily(
                "dd_syncer_pending_pushes", "Pushes in the fragment's open round.",
                labels=["shard", "fragment"],
            ),
        }  # fmt: skip
        pushes = CounterMetricFamily(
            "dd_syncer_pushes",
            "Pushes answered, by outcome: accepted into a round, late (dropped), duplicate.",
            labels=["shard", "fragment", "outcome"],
        )
        for p, f in owned:
            for key, family in families.items():
                value = len(f[key]) if key == "pending" else f[key]
                family.add_metric([shard, p], value)
            for outcome, key in (
                ("accepted", "accepted_pushes"),
                ("late", "late_pushes"),
                ("duplicate", "duplicate_pushes"),
            ):
                pushes.add_metric([shard, p, outcome], f[key])
        yield from families.values()
        yield pushes
        sizes = status["merge_sizes"]  # sizes[k]: merges of k pushes
        buckets, total = [], 0
        for k, n in enumerate(sizes):
            total += n
            buckets.append((str(k), total))
        buckets.append(("+Inf", total))
        family = HistogramMetricFamily(
            "dd_syncer_merge_size_pushes", "Pushes per merge.", labels=["shard"]
        )
        family.add_metric([shard], buckets, sum(k * n for k, n in enumerate(sizes)))
        yield family

    def _learners(self, status: dict[str, Any], shard: str) -> Iterator[Any]:
        live = set(status["live"])
        names = {
            "step": (
                "dd_syncer_learner_step",
                "Inner steps the learner reported.",
                GaugeMetricFamily,
            ),
            "loss": (
                "dd_syncer_learner_loss",
                "The learner's latest training loss.",
                GaugeMetricFamily,
            ),
            "staleness": (
                "dd_syncer_learner_staleness_versions",
                "Versions the learner's oldest fragment is behind the syncer's.",
                GaugeMetricFamily,
            ),
            "heartbeat_age_s": (
                "dd_syncer_learner_heartbeat_age_seconds",
                "Seconds since the learner was last heard from.",
                GaugeMetricFamily,
            ),
            "dropped_pushes": (
                "dd_syncer_learner_dropped_pushes",
                "The learner's accepted pushes dropped with a refused merge.",
                CounterMetricFamily,
            ),
        }
        families = {k: cls(n, t, labels=["shard", "learner"]) for k, (n, t, cls) in names.items()}
        up = GaugeMetricFamily(
            "dd_syncer_learner_up", "1 while the learner is live (heard from, not done).",
            labels=["shard", "learner"],
        )  # fmt: skip
        joins = CounterMetricFamily(
            "dd_syncer_learner_registrations",
            "Registrations of the learner (the first, then one per restart).",
            labels=["shard", "learner"],
        )
        counts = {"live": 0, "done": 0, "lost": 0}
        for i, x in status["learners"].items():
            for key, family in families.items():
                family.add_metric([shard, i], _finite(x[key]))
            is_live = int(i) in live
            up.add_metric([shard, i], float(is_live))
            joins.add_metric([shard, i], x["incarnation"] + 1)
            counts["live" if is_live else "done" if x["state"] == "done" else "lost"] += 1
        yield from families.values()
        yield up
        yield joins
        learners = GaugeMetricFamily(
            "dd_syncer_learners",
            "Learners known to the syncer: live, done (finished), lost (silent past the timeout).",
            labels=["shard", "status"],
        )
        for key, n in counts.items():
            learners.add_metric([shard, key], n)
        yield learners

    def _durability(self, shard: str) -> Iterator[Any]:
        state = self.state
        yield _gauge(
            "dd_syncer_uncommitted_changes",
            "Changes not yet durable (acknowledgements wait for them).",
            shard,
            state.seq - state.committed_seq if state.durable else 0,
        )
        yield _gauge(
            "dd_syncer_wal_failed",
            "1 once the write-ahead log failed.",
            shard,
            float(bool(state.wal_failed)),
        )
        if self.committer is None:
            return
        stats = self.committer.stats()
        for name, text, count, mean in (
            (
                "dd_syncer_wal_sync_seconds",
                "Write-ahead log syncs (fsync).",
                "syncs",
                "sync_mean_s",
            ),
            (
                "dd_syncer_snapshot_seconds",
                "Snapshots of the whole state.",
                "snapshots",
                "snapshot_mean_s",
            ),
        ):
            family = SummaryMetricFamily(name, text, labels=["shard"])
            family.add_metric([shard], stats[count], stats[count] * stats[mean])
            yield family


def _counter(name: str, text: str, shard: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=["shard"])
    family.add_metric([shard], value)
    return family


def _gauge(name: str, text: str, shard: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=["shard"])
    family.add_metric([shard], _finite(value))
    return family


def serve_metrics(server: Any, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Serves `server`'s metrics at `http://HOST:PORT/metrics` (`obs.http`); returns the server.

    A scrape may present the run's scrape secret (`comm.auth.scrape_secret`) or any secret the
    syncer accepts for its RPCs (the run token, a learner's credential). A port that cannot be
    bound is replaced by any free one (said on stderr).
    """
    from decoupled_diloco.comm import auth
    from decoupled_diloco.obs.http import HttpServer, metrics_app, same_secret, serve_on

    registry = prometheus_client.CollectorRegistry()
    registry.register(SyncerMetrics(server))
    token = server.service.token
    scrape = same_secret(auth.scrape_secret(token))

    def check(secret: str) -> bool:
        return scrape(secret) or auth.identify(secret, token) is not None

    routes = {"/metrics": metrics_app(registry)}
    make = lambda p: HttpServer(check, routes, host, p)  # noqa: E731
    return serve_on(port, make, f"[syncer {server.shard}] metrics").start()
