"""A learner's Prometheus metrics, read from the learner at each scrape (docs/operations.md).

`LearnerMetrics(learner)` is a `prometheus_client` collector over a `learner.Learner` and its link:
step, tokens, loss, step time, stall, state, traffic, pushes by outcome, restarts; push and pull
latencies are histograms, observed as each round trip ends (`DecoupledSync.on_trip`). Every
sample carries the `learner` label.

  python -m decoupled_diloco.learner ... --metrics_port=0 --metrics_port_file=PATH
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from decoupled_diloco.obs.timeline import STATES

# Seconds: a push of a tiny model's fragment takes milliseconds on loopback, a 1B model's a
# minute; a pull waits for the round to close (quorum, grace), up to the rpc timeout.
_TRIP_BUCKETS = (0.005, 0.02, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _finite(x: Any) -> float:
    try:
        value = float(x)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


class LearnerMetrics(Collector):
    """The metrics of one learner process (an island's leader)."""

    def __init__(self, learner: Any):
        self.learner = learner
        self.label = str(learner.id)
        self._push_s, self._pull_s = (
            prometheus_client.Histogram(
                f"dd_learner_{what}_seconds", text, ["learner"], buckets=_TRIP_BUCKETS,
                registry=None,
            )
            for what, text in (
                ("push", "Delivering one fragment's push (retries included)."),
                ("pull", "From a push's answer until the merge holding it arrived."),
            )
        )  # fmt: skip
        for histogram in (self._push_s, self._pull_s):
            histogram.labels(self.label)
        learner.sync.on_trip = self.observe_trip

    def observe_trip(self, trip: Any) -> None:
        """Records one round trip's push and pull times (a final push has no pull)."""
        self._push_s.labels(self.label).observe(trip.push_s)
        if trip.version >= 0:
            self._pull_s.labels(self.label).observe(trip.pull_s)

    def collect(self) -> Iterator[Any]:
        """One scrape's samples."""
        learner, sync, label = self.learner, self.learner.sync, self.label
        summary = sync.summary()

        def one(family: Any, value: Any) -> Any:
            family.add_metric([label], _finite(value))
            return family

        yield one(
            GaugeMetricFamily("dd_learner_step", "Inner steps done.", labels=["learner"]), sync.step
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_tokens", "Tokens (the task's unit) trained on.", labels=["learner"]
            ),
            sync.tokens,
        )
        yield one(
            GaugeMetricFamily(
                "dd_learner_loss", "Training loss of the latest step.", labels=["learner"]
            ),
            sync.counters.loss,
        )
        yield one(
            GaugeMetricFamily(
                "dd_learner_step_time_seconds",
                "Mean inner step time over the latest window.",
                labels=["learner"],
            ),
            sync.schedule.step_time_s,
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_stall_seconds",
                "Time the step loop waited on the syncer.",
                labels=["learner"],
            ),
            sync.counters.blocked_s,
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_sync_host_seconds",
                "Time the step loop spent on host copies and encoding for syncs.",
                labels=["learner"],
            ),
            sync.counters.sync_host_s,
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_sent_bytes",
                "Bytes of pushes (and pulls' requests) sent.",
                labels=["learner"],
            ),
            summary["bytes_sent"],
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_received_bytes", "Bytes of pulls received.", labels=["learner"]
            ),
            summary["bytes_received"],
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_retries", "Retried pushes and pulls.", labels=["learner"]
            ),
            summary["retries"],
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_sync_errors", "Round trips given up on an error.", labels=["learner"]
            ),
            len(summary["errors"]),
        )
        yield one(
            GaugeMetricFamily(
                "dd_learner_unsent_pushes",
                "Pushes not yet delivered (an outage).",
                labels=["learner"],
            ),
            summary["pushes_unsent"],
        )
        yield one(
            CounterMetricFamily(
                "dd_learner_restarts",
                "Restarts of this learner (from its checkpoint's count).",
                labels=["learner"],
            ),
            learner.restarts,
        )
        pushes = CounterMetricFamily(
            "dd_learner_pushes", "Pushes answered, by the syncer's answer.",
            labels=["learner", "outcome"],
        )  # fmt: skip
        for outcome, n in sorted(summary["pushes"].items()):
            pushes.add_metric([label, outcome], n)
        pushes.add_metric([label, "folded"], summary["pushes_folded"])
        pushes.add_metric([label, "dropped"], summary["pushes_dropped"])
        pushes.add_metric([label, "deferred"], summary["pushes_deferred"])
        pushes.add_metric([label, "rebased"], summary["pushes_rebased"])
        yield pushes
        versions = GaugeMetricFamily(
            "dd_learner_fragment_version", "Version of each fragment the learner holds.",
            labels=["learner", "fragment"],
        )  # fmt: skip
        for p, version in enumerate(list(sync.versions)):
            versions.add_metric([label, str(p)], version)
        yield versions
        state = GaugeMetricFamily(
            "dd_learner_state",
            "1 for the state the learner is in (starting, restoring, compiling, stepping, ...).",
            labels=["learner", "state"],
        )
        current = getattr(learner, "state", "starting")
        for name in STATES:
            state.add_metric([label, name], float(name == current))
        yield state
        yield from self._push_s.collect()
        yield from self._pull_s.collect()


def serve_metrics(learner: Any, own_secret: str, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Serves `learner`'s metrics at `http://HOST:PORT/metrics`; returns the `obs.http` server.

    A scrape may present the secret the learner holds (the run token, or its own credential,
    `comm.auth`) or the run's scrape secret, when it was given one (`DD_SCRAPE_TOKEN`, set by
    the launcher): one metrics-only secret then serves every target, and no learner ever sees
    the run token. A port that cannot be bound is replaced by any free one (said on stderr).
    """
    import os

    from decoupled_diloco.comm import auth
    from decoupled_diloco.obs.http import HttpServer, metrics_app, same_secret, serve_on

    registry = prometheus_client.CollectorRegistry()
    registry.register(LearnerMetrics(learner))
    own, scrape = same_secret(own_secret), same_secret(os.environ.get(auth.SCRAPE_ENV, ""))
    routes = {"/metrics": metrics_app(registry)}
    make = lambda p: HttpServer(lambda s: own(s) or scrape(s), routes, host, p)  # noqa: E731
    return serve_on(port, make, f"[learner {learner.id}] metrics").start()
