"""Learners in-process against a real syncer on 127.0.0.1: schedule, DyLU, merge-back.

Every test drives the learner's link (`DecoupledSync`) through the calls a training loop
makes (`connect`, `join`, `step_done`, `apply_arrivals`, `close`), never its internals.
"""

import threading
import time

import jax
import numpy as np
import pytest

from decoupled_diloco.learner.learner import Learner
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config
from tests.helpers import due_fragments

TOKEN = "learner-test"


def _config(**overrides):
    return tiny_config(mode="decoupled", **{"decoupled.syncer.token": TOKEN, **overrides})


def _wait(predicate, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _leaves(sync, params):
    return [np.asarray(x) for x in sync.treedef.flatten_up_to(params)]


def _shift(params, by):
    return jax.tree.map(lambda x: x + by, params)


class _Cluster:
    """A syncer on a free loopback port and in-process learners joined to it."""

    def __init__(self, config):
        self.config = config
        self.server = SyncerServer(config, host="127.0.0.1", port=0).start()
        self.learners = []

    def join(self, i, devices=None, mesh_shape=(1, 1)):
        devices = devices or jax.devices()[i : i + 1]
        learner = Learner(
            self.config, i, f"127.0.0.1:{self.server.port}", devices=devices, mesh_shape=mesh_shape
        )
        self.learners.append(learner)
        learner.connect(peers_s=0)
        return learner, learner.sync.join(learner.island.init(0).params)

    def fragment(self, p):
        return self.server.state.fragments[p]

    def close(self):
        for learner in self.learners:
            learner.sync.close()
        self.server.stop(0)


def _ended(sync):
    """Whether every round trip has ended.

    A trip puts its merge in the inbox or counts its refusal, then ends (it lets go of its
    arrays and trims the heap): until then its fragment is under way (held at its next due
    step, crossing at a pause). Tests that go on from a trip's outcome wait for its end too.
    """
    return all(trip.done() for trip in sync.pusher.trips.values())


def _back(sync):
    """The merges in the inbox once every round trip has ended (`_ended`), else None."""
    return sync.arrived() if _ended(sync) else None


def _steps(sync, params, n, tokens=64):
    for _ in range(n):
        sync.step_done(params, tokens)


def test_schedule_matches_the_staggered_rule_and_dynamic_h_scales_with_speed():
    config = _config(inner_steps=8, **{"decoupled.fragments": 4})
    learner = Learner(config, 0, "127.0.0.1:1", devices=jax.devices()[:1], mesh_shape=(1, 1))
    schedule = learner.sync.schedule
    for step in range(1, 3 * 8 + 1):
        assert schedule.due(step) == due_fragments(step, 4, 8)
    assert schedule.local_h() == 8
    schedule.fastest_step_s, schedule.step_time_s = 0.1, 0.3
    assert schedule.local_h() == 8  # DyLU off: H whatever the speeds
    dylu = Learner(
        _config(inner_steps=8, **{"decoupled.dynamic_local_updates": True}),
        1,
        "127.0.0.1:1",
        devices=jax.devices()[:1],
        mesh_shape=(1, 1),
    ).sync.schedule
    dylu.fastest_step_s, dylu.step_time_s = 0.1, 0.3
    assert dylu.local_h() == 2  # floor(8 * 0.1 / 0.3)
    dylu.fastest_step_s, dylu.step_time_s = 0.1, 0.1
    assert dylu.local_h() == 8


def test_two_learners_on_different_meshes_exchange_fragments(corpus):
    config = _config(train_steps=24, inner_steps=4, **{"eval.every": 0, "outer.merge": "rda"})
    server = SyncerServer(config, host="127.0.0.1", port=0).start()
    try:
        address = f"127.0.0.1:{server.port}"
        learners = [
            Learner(config, 0, address, devices=jax.devices()[:1], mesh_shape=(1, 1)),
            Learner(config, 1, address, devices=jax.devices()[4:8], mesh_shape=(2, 2)),
        ]
        results = {}

        def connect_and_run(learner):
            learner.connect()  # waits for the other learner to register: start together
            results[learner.id] = learner.run()

        threads = [threading.Thread(target=connect_and_run, args=(x,)) for x in learners]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert sorted(results) == [0, 1]
        # On data leases the two share the budget of 2 x 24 steps (leases of 4 batches); a
        # hole a refused push left is trained again (the ledger below: each batch once).
        assert sum(r["steps"] for r in results.values()) >= 2 * 24
        for r in results.values():
            assert r["steps"] > 0 and not r["errors"] and np.isfinite(r["final_loss"])
            assert r["pushes"]["accepted"] >= 2 and max(r["versions"]) >= 1
        deadline = time.monotonic() + 30  # the last rounds close within the syncer's next tick
        while any(f["pending"] for f in server.state.status()["fragments"]):
            assert time.monotonic() < deadline, server.state.status()["fragments"]
            time.sleep(0.02)
        status = server.state.status()
        assert status["merges"] >= 6
        ledger = status["data_ledger"]
        assert ledger["consumed_once"] == ledger["windows"] and ledger["repeated"] == 0
        assert {m for rec in status["merge_log"] for m in rec["learners"]} == {0, 1}
    finally:
        server.stop(0)


@pytest.mark.parametrize("alpha", [0.25, 0.0])
def test_alpha_mixes_local_and_global_values(alpha):
    config = _config(
        inner_steps=2,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.alpha": alpha,
            "decoupled.apply_on_arrival": True,
            "decoupled.keep_overlap": False,
        },
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync
        theta = _shift(params, -0.25)  # Δ = 0.25 everywhere
        _steps(sync, theta, 2)  # fragment 0 due after step 2: pushed
        _wait(lambda: _back(sync) == {0: 1}, "the merge")
        local = _shift(params, 1.0)  # the live values when the merge is applied
        local_values = [np.array(x) for x in _leaves(sync, local)]  # (apply_arrivals donates)
        mixed = _leaves(sync, sync.apply_arrivals(local))
        merged = cluster.fragment(0).values
        first = sync.partition[0][0].index
        assert not np.allclose(merged[0], _leaves(sync, params)[first])  # the merge moved it
        for spec, value in zip(sync.partition[0], merged, strict=True):
            want = alpha * local_values[spec.index] + (1 - alpha) * value
            np.testing.assert_allclose(mixed[spec.index], want, rtol=1e-6, atol=1e-7)
        assert sync.versions == [1]
        # The new values took the old ones' buffers, also where they are the merged values
        # alone (α = 0, no overlap): no second copy of the fragment was made.
        assert all(x.is_deleted() for x in sync.treedef.flatten_up_to(local))
    finally:
        cluster.close()


def test_a_push_waits_for_the_merge_that_holds_it_not_for_an_older_one():
    config = _config(
        inner_steps=4,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.overlap_steps": 2,
            "decoupled.apply_on_arrival": False,
            "decoupled.keep_overlap": False,  # the merged values as they are
            "decoupled.grace_safety": 0.5,
        },
    )
    cluster = _Cluster(config)
    try:
        cluster.server.state.ema_step.update(1.0)  # grace window 0.5 * 2 steps * 1 s = 1 s
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        # Learner 1's push of version 0 merges alone once its grace window has passed.
        _steps(one.sync, _shift(params1, -0.25), 4)
        _wait(lambda: cluster.fragment(0).version >= 1, "the first merge")
        # Learner 0's push, still anchored at version 0, joins the next round (version 2):
        # what comes back must hold it, not be version 1, merged before it arrived.
        _steps(zero.sync, _shift(params0, -0.25), 4)
        _wait(lambda: _back(zero.sync), "learner 0's merge")
        assert zero.sync.arrived() == {0: 2} and cluster.fragment(0).version == 2
        assert cluster.server.state.merge_log[-1]["learners"] == [0]
        _steps(zero.sync, params0, 2)  # τ = 2 steps after the push
        got = _leaves(zero.sync, zero.sync.apply_arrivals(params0))
        for spec, want in zip(zero.sync.partition[0], cluster.fragment(0).values, strict=True):
            np.testing.assert_array_equal(got[spec.index], want)
    finally:
        cluster.close()


def test_a_fragment_due_while_its_round_trip_is_under_way_is_held_then_pushed_whole():
    # Issue 22: behind a slow link a learner must not queue pushes of a fragment (they grow
    # older until refused as late, and on data leases their data is trained again). Learner
    # 0's push of step 4 waits in a round that needs learner 1 too: at step 8 the fragment is
    # held (nothing sent), the learner steps on; once the merge is back and applied, the next
    # step pushes every step since the first push (5..9), anchored at the merged version.
    config = _config(
        inner_steps=4,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 2,
            "decoupled.overlap_steps": 1,
            "decoupled.keep_overlap": False,
        },
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        _steps(zero.sync, _shift(params0, -0.25), 4)  # step 4: the push
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's push")
        _steps(zero.sync, _shift(params0, -0.5), 4)  # step 8: due, its round trip under way
        assert zero.sync.pusher.held == {0} and zero.sync.counters.deferred == 1
        assert zero.sync.states[0].round == 1 and zero.sync.states[0].steps_since == 4
        _steps(one.sync, _shift(params1, -0.25), 4)  # the round closes (version 1)
        _wait(lambda: _back(zero.sync) == {0: 1}, "learner 0's merge")
        merged = zero.sync.apply_arrivals(_shift(params0, -0.5))
        assert zero.sync.versions[0] == 1
        zero.sync.step_done(_shift(merged, -0.125), 64)  # step 9: pushed now, 5 steps
        assert zero.sync.pusher.held == set() and zero.sync.states[0].round == 2
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's held push")
        pending = cluster.fragment(0).pending[0]
        assert (pending.steps, pending.base_version) == (5, 1)
        for delta in cluster.server.state.pending_gradient(0, 0):
            np.testing.assert_allclose(delta, 0.125, rtol=1e-5)
        assert zero.sync.summary()["pushes_deferred"] == 1
    finally:
        cluster.close()


def test_a_pause_between_leases_pushes_ordinary_pushes_whose_merges_become_anchors():
    # A leased learner with no lease free pushes what it trained (`pause`, polled until it
    # says settled). Its pushes' merges must come back as its anchors: a final push brings
    # none, and the next push, anchored where the flushed one was, would carry the flushed
    # progress again (and, its anchor ever older, be refused as late: holes handed again).
    config = _config(inner_steps=8, **{"decoupled.fragments": 2, "decoupled.quorum": 1})
    cluster = _Cluster(config)
    try:
        zero, params = cluster.join(0)
        _steps(zero.sync, _shift(params, -0.25), 2)  # neither fragment due yet
        assert not zero.sync.pause()  # pushed, not settled
        assert [f.steps_since for f in zero.sync.states] == [0, 0] and [
            f.round for f in zero.sync.states
        ] == [1, 1]
        _wait(zero.sync.pause, "the pause settled: both pushes answered")
        assert zero.sync.counters.pushes["late"] == 0 and [f.round for f in zero.sync.states] == [
            1,
            1,
        ]
        # Their merges come back as anchors (a poll of the pause, or the next step, applies).
        _wait(lambda: zero.sync.pause() and zero.sync.versions == [1, 1], "both merges")
        for p in (0, 1):  # the anchors are the merged values, so are the parameters
            for x, want in zip(zero.sync.states[p].anchor, cluster.fragment(p).values, strict=True):
                np.testing.assert_array_equal(x, want)
        got = _leaves(zero.sync, zero.sync.apply_arrivals(params))
        for p in (0, 1):
            for spec, want in zip(zero.sync.partition[p], cluster.fragment(p).values, strict=True):
                np.testing.assert_array_equal(got[spec.index], want)
    finally:
        cluster.close()


def test_a_pause_waits_for_a_round_trip_under_way_then_pushes_from_its_merge():
    # Issue 22: at a pause, a fragment whose last push was accepted but whose merge is still
    # coming back must not be pushed yet: anchored a round trip back, such pushes at the end
    # of a learner behind a slow link passed `max_staleness` and each cost a pull and a
    # second push. Learner 0's push of step 4 waits in a round that needs learner 1 (quorum
    # 2); the pause after step 6 pushes nothing until that merge is back, then pushes steps
    # 5-6 anchored at it.
    config = _config(
        inner_steps=4,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 2,
            "decoupled.overlap_steps": 1,  # (the steps since the push kept: `keep_overlap`)
        },
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        _steps(zero.sync, _shift(params0, -0.25), 4)  # step 4: the push
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's push")
        _wait(lambda: zero.sync.pusher.jobs[0].answered_late is False, "its answer: accepted")
        _steps(zero.sync, _shift(params0, -0.5), 2)  # steps 5-6, then the pause
        assert not zero.sync.pause()
        assert zero.sync.states[0].round == 1 and zero.sync.states[0].steps_since == 2
        _steps(one.sync, _shift(params1, -0.25), 4)  # the round closes (version 1)
        _wait(lambda: _ended(zero.sync), "learner 0's round trip")
        assert not zero.sync.pause()  # the merge applied, then steps 5-6 pushed from it
        assert zero.sync.versions[0] == 1 and zero.sync.states[0].round == 2
        _wait(lambda: 0 in cluster.fragment(0).pending, "the pause's push")
        pending = cluster.fragment(0).pending[0]
        assert (pending.steps, pending.base_version) == (2, 1)
        for delta in cluster.server.state.pending_gradient(0, 0):
            np.testing.assert_allclose(delta, 0.25, rtol=1e-5)
        _wait(zero.sync.pause, "the pause settled: its push answered")
        assert zero.sync.counters.pushes["late"] == 0
    finally:
        cluster.close()


def test_a_pause_pushes_a_fragment_whose_round_trip_is_still_under_way_after_rpc_timeout_s():
    # Behind a link far below what the run needs pulls can take many minutes: the pause then
    # stops waiting for the trip after `rpc_timeout_s` and pushes the fragment as it is. Here
    # learner 0's first push still waits in its round (quorum 2), so the syncer takes the
    # pause's push in its place: 4 + 2 steps.
    config = _config(
        inner_steps=4,
        **{"decoupled.fragments": 1, "decoupled.quorum": 2, "decoupled.overlap_steps": 1},
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), _ = cluster.join(0), cluster.join(1)
        _steps(zero.sync, _shift(params0, -0.25), 4)  # step 4: the push
        _wait(lambda: zero.sync.pusher.jobs[0].answered_late is False, "its answer: accepted")
        _steps(zero.sync, _shift(params0, -0.5), 2)
        assert not zero.sync.pause() and zero.sync.states[0].round == 1  # waits for the trip
        zero.sync.pusher.paused_at -= config.decoupled.syncer.rpc_timeout_s  # (its time is up)
        assert not zero.sync.pause() and zero.sync.states[0].round == 2  # pushed as it is
        _wait(lambda: cluster.fragment(0).pending[0].steps == 6, "the push in its place")
        assert cluster.fragment(0).pending[0].base_version == 0
    finally:
        cluster.close()


def test_the_final_flush_lets_a_round_trip_under_way_end_and_pushes_from_its_merge():
    # As a pause does (above), the run's final flush holds a fragment whose last push was
    # accepted but whose merge is still coming back: pushed at once, its outer gradient would
    # hold that push's 4 steps again, counted twice once both are merged.
    config = _config(
        inner_steps=4,
        **{"decoupled.fragments": 1, "decoupled.quorum": 2, "decoupled.overlap_steps": 1},
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        _steps(zero.sync, _shift(params0, -0.25), 4)  # step 4: the push
        _wait(lambda: zero.sync.pusher.jobs[0].answered_late is False, "its answer: accepted")
        _steps(zero.sync, _shift(params0, -0.5), 2)  # steps 5-6, then the run's end
        flushing = threading.Thread(target=zero.sync.flush)
        flushing.start()
        _wait(lambda: zero.sync.states[0].round == 1 and flushing.is_alive(), "the flush waiting")
        _steps(one.sync, _shift(params1, -0.25), 4)  # the round closes (version 1)
        flushing.join(60)
        assert not flushing.is_alive() and zero.sync.versions[0] == 1
        _wait(lambda: 0 in cluster.fragment(0).pending, "the final push")
        pending = cluster.fragment(0).pending[0]
        assert (pending.steps, pending.base_version) == (2, 1)
        for delta in cluster.server.state.pending_gradient(0, 0):
            np.testing.assert_allclose(delta, 0.25, rtol=1e-5)
    finally:
        cluster.close()


def _late_config(overlap):
    """One fragment, quorum 1, leases of 32 batches, plain averaging; any stale push late."""
    return _config(
        inner_steps=4,
        train_steps=64,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.overlap_steps": overlap,
            "decoupled.data_shards": 4,
            "decoupled.grace_safety": 0.5,
            "decoupled.syncer.max_staleness": 0,
            "outer.lr": 1.0,
            "outer.momentum": 0.0,
            "outer.nesterov": False,
        },
    )


def _refused_as_late(cluster):
    """Learner 1 merges version 1 (Δ 0.25); learner 0's push of 4 steps (Δ 0.5, lease 0),
    anchored at version 0, is refused as late and the current values come back.

    Returns learner 0, its initial parameters, and Θ_1.
    """
    cluster.server.state.ema_step.update(1.0)  # grace window 0.5 * 1 step * 1 s
    (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
    assert zero.sync.client.lease(0).lease == 0 and one.sync.client.lease(1).lease == 1
    for i in range(4):
        one.sync.step_done(_shift(params1, -0.25), 64, data=(1, i))
    _wait(lambda: cluster.fragment(0).version == 1, "learner 1's merge")
    theta1 = [np.array(x) for x in cluster.fragment(0).values]
    for i in range(4):
        zero.sync.step_done(_shift(params0, -0.5), 64, data=(0, i))
    _wait(lambda: _back(zero.sync) == {0: 1}, "the current values after the refusal")
    assert zero.sync.counters.pushes["late"] == 1
    return zero, params0, theta1


def test_the_work_of_a_push_refused_as_late_goes_with_the_next_push():
    # Issue 22: behind a slow link pushes arrive late; dropping their work on data leases hands
    # their batches out again, to be trained and pushed late again. Learner 0's push, anchored
    # at version 0, arrives after learner 1's merge made version 1 (max_staleness 0: late).
    # The current values are applied keeping all of learner 0's progress since its anchor, and
    # its next push holds the refused steps and batches too: Δ = 0.625, of which a merge of 1
    # of the 2 live learners steps half (`share`): Θ_2 = Θ_1 − 0.3125.
    cluster = _Cluster(_late_config(overlap=1))  # leases of 32 batches
    try:
        state = cluster.server.state
        zero, params0, theta1 = _refused_as_late(cluster)
        zero.sync.step_done(_shift(params0, -0.5), 64, data=(0, 4))  # τ = 1 step
        params = zero.sync.apply_arrivals(_shift(params0, -0.5))
        assert zero.sync.versions == [1] and zero.sync.counters.rebased == 1
        assert [f.steps_since for f in zero.sync.states] == [5] and [
            f.data_since for f in zero.sync.states
        ] == [[[0, 0, 5]]]
        got = _leaves(zero.sync, params)
        for spec, want in zip(zero.sync.partition[0], theta1, strict=True):
            np.testing.assert_allclose(got[spec.index], want - 0.5, rtol=1e-6, atol=1e-6)
        for i in range(5, 8):  # step 8 pushes: 8 steps, batches 0..7, Δ = 0.625
            zero.sync.step_done(_shift(params, -0.125), 64, data=(0, i))
        _wait(lambda: cluster.fragment(0).version == 2, "learner 0's merge")
        for value, before in zip(cluster.fragment(0).values, theta1, strict=True):
            np.testing.assert_allclose(value, before - 0.3125, rtol=1e-6, atol=1e-6)
        assert state.merge_log[-1]["learners"] == [0]
        report = state.ledger.report([[[0, 0, 8], [1, 0, 4]]])
        assert report["repeated"] == 0
        assert zero.sync.summary()["pushes_rebased"] == 1
    finally:
        cluster.close()


def test_a_pause_rebases_a_late_push_before_its_flush():
    # A learner whose lease ran out pauses (pushes, then asks for leases as flushed): a late
    # push's merge that came before its τ steps were up is applied at the pause, so that its
    # pushes carry that push's work; asked as flushed before, the learner could be handed its
    # own batches again and push them twice. The loop's next `apply_arrivals` returns the
    # parameters the pause made (Θ_2 once its merge is back: nothing trained since).
    cluster = _Cluster(_late_config(overlap=2))
    try:
        state = cluster.server.state
        zero, params0, theta1 = _refused_as_late(cluster)
        assert not zero.sync.pause()  # rebased, then pushed from version 1
        assert zero.sync.counters.rebased == 1 and zero.sync.versions == [1]
        _wait(zero.sync.pause, "the pause settled: its push answered")
        _wait(lambda: cluster.fragment(0).version == 2, "the pause's merge")
        assert state.merge_log[-1]["learners"] == [0] and state.merge_log[-1]["steps"] == [4]
        for value, before in zip(cluster.fragment(0).values, theta1, strict=True):
            np.testing.assert_allclose(value, before - 0.25, rtol=1e-6, atol=1e-6)  # 1 of 2
        _wait(lambda: zero.sync.pause() and zero.sync.versions == [2], "its merge applied")
        got = _leaves(zero.sync, zero.sync.apply_arrivals(params0))  # the pause's parameters
        for spec, want in zip(zero.sync.partition[0], cluster.fragment(0).values, strict=True):
            np.testing.assert_array_equal(got[spec.index], want)  # its progress is in Θ_2
    finally:
        cluster.close()


@pytest.mark.parametrize("on_arrival", [False, True])
def test_a_merge_waits_tau_steps_unless_applied_on_arrival_and_its_lag_is_logged(on_arrival):
    config = _config(
        inner_steps=8,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.overlap_steps": 5,
            "decoupled.apply_on_arrival": on_arrival,
        },
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync
        _steps(sync, _shift(params, -0.25), 8)  # fragment 0 is due after step 8
        _wait(lambda: _back(sync) == {0: 1}, "the merge")
        _steps(sync, params, 2)  # two steps after the push: applied only on arrival
        sync.apply_arrivals(params)
        assert sync.versions == [1 if on_arrival else 0]
        _steps(sync, params, 3)  # τ = 5 steps after the push
        sync.apply_arrivals(params)
        assert sync.versions == [1] and sync.arrived() == {}
        lag = 2 if on_arrival else 5
        assert sync.counters.applied == [
            {"fragment": 0, "version": 1, "pushed_at": 8, "applied_at": 8 + lag}
        ]
    finally:
        cluster.close()


def test_wait_for_merge_holds_the_step_until_the_merge_of_every_learner_arrives():
    """`wait_for_merge` (synchronous DiLoCo across the syncer): once its merge is due, the
    learner's next `apply_arrivals` waits for the merge its push is in, here one that needs the
    other learner's push too (quorum 2), and applies it at the step it pushed."""
    config = _config(
        inner_steps=4,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 2,
            "decoupled.overlap_steps": 0,
            "decoupled.wait_for_merge": True,
        },
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        live = _shift(params0, -0.25)  # θ after learner 0's 4 steps
        _steps(zero.sync, live, 4)  # learner 0 pushes after step 4
        result = {}
        waiter = threading.Thread(
            target=lambda: result.update(params=zero.sync.apply_arrivals(live))
        )
        waiter.start()
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's push at the syncer")
        assert cluster.fragment(0).version == 0  # no merge without learner 1: still waiting
        _steps(one.sync, _shift(params1, -0.25), 4)  # learner 1's push completes the round
        waiter.join(timeout=60)
        assert not waiter.is_alive(), "apply_arrivals did not return after the merge"
        assert zero.sync.versions == [1]
        assert zero.sync.counters.applied == [
            {"fragment": 0, "version": 1, "pushed_at": 4, "applied_at": 4}
        ]
        got = _leaves(zero.sync, result["params"])
        for spec, want in zip(zero.sync.partition[0], cluster.fragment(0).values, strict=True):
            np.testing.assert_array_equal(got[spec.index], want)
    finally:
        cluster.close()


def test_keep_overlap_keeps_the_steps_trained_while_a_fragment_was_in_flight():
    config = _config(
        inner_steps=8,
        **{
            "decoupled.fragments": 2,
            "decoupled.quorum": 1,
            "decoupled.keep_overlap": True,
            "decoupled.apply_on_arrival": True,
        },
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync
        at_push = _shift(params, -0.25)
        _steps(sync, at_push, 4)  # fragment 0 is due after step 4 (offset 8 / 2)
        _wait(lambda: _back(sync) == {0: 1}, "the merge")
        now = _shift(params, 0.25)  # the overlap steps' progress: +0.5 since the push
        now_values = [np.array(x) for x in _leaves(sync, now)]  # (apply_arrivals donates)
        got = _leaves(sync, sync.apply_arrivals(now))
        merged = cluster.fragment(0).values
        for spec, value in zip(sync.partition[0], merged, strict=True):  # Θ + (θ_now − θ_push)
            np.testing.assert_allclose(got[spec.index], value + 0.5, rtol=1e-6, atol=1e-6)
        for spec in sync.partition[1]:  # not merged: the live values
            np.testing.assert_array_equal(got[spec.index], now_values[spec.index])
        assert sync.versions == [1, 0]
        # The merge reused the merged fragment's buffers (no second copy of it was made); the
        # other fragment's arrays are the caller's still.
        old = sync.treedef.flatten_up_to(now)
        assert all(old[spec.index].is_deleted() for spec in sync.partition[0])
        assert not any(old[spec.index].is_deleted() for spec in sync.partition[1])
    finally:
        cluster.close()


def test_a_tree_holding_one_array_in_two_leaves_is_merged_without_donating():
    config = _config(
        inner_steps=8,
        **{"decoupled.fragments": 2, "decoupled.quorum": 1, "decoupled.apply_on_arrival": True},
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync
        _steps(sync, _shift(params, -0.25), 4)  # fragment 0 is due after step 4
        _wait(lambda: _back(sync) == {0: 1}, "the merge")
        leaves = list(sync.treedef.flatten_up_to(_shift(params, 0.25)))
        # A leaf of fragment 0 and one of fragment 1 of the same shape: one array in both.
        a, b = next(
            (x, y)
            for x in sync.partition[0]
            for y in sync.partition[1]
            if leaves[x.index].shape == leaves[y.index].shape
        )
        leaves[b.index] = leaves[a.index]
        got = sync.treedef.flatten_up_to(sync.apply_arrivals(sync.treedef.unflatten(leaves)))
        assert sync.versions == [1, 0]
        assert not any(x.is_deleted() for x in leaves)  # the caller's tree is intact
        np.testing.assert_array_equal(np.asarray(got[b.index]), np.asarray(leaves[a.index]))
    finally:
        cluster.close()


def test_keep_unsent_moves_the_residual_into_the_parameters_when_its_merge_arrives():
    z = {
        "compression.scheme": "topk",
        "compression.density": 0.02,
        "compression.topk_values": "none",
        "compression.error_feedback": True,
        "compression.keep_unsent": True,
    }
    config = _config(
        inner_steps=8,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.keep_overlap": False,
            "decoupled.apply_on_arrival": True,
            **z,
        },
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync

        def residual():
            return _leaves(sync, sync.checkpoint_items()["ef_residual"])

        _steps(sync, _shift(params, -1.0), 8)  # Δ = 1 everywhere; top-k sends a few entries
        kept = residual()
        for spec in sync.partition[0]:
            assert 0 < np.count_nonzero(kept[spec.index]) < kept[spec.index].size
            assert np.all((kept[spec.index] == 0) | np.isclose(kept[spec.index], 1.0))
        _wait(lambda: _back(sync) == {0: 1}, "the merge")
        theta = sync.apply_arrivals(params)
        got = _leaves(sync, theta)
        for spec, value in zip(sync.partition[0], cluster.fragment(0).values, strict=True):
            # θ ← Θ − residual; the buffer keeps it too (for checkpoints)
            np.testing.assert_allclose(got[spec.index], value - kept[spec.index], rtol=1e-6)
            np.testing.assert_array_equal(residual()[spec.index], kept[spec.index])
        # The next push: Δ = anchor − θ = residual, which must not be added again.
        _steps(sync, theta, 8)
        again = residual()
        for spec in sync.partition[0]:
            assert np.count_nonzero(again[spec.index]) < np.count_nonzero(kept[spec.index])
            assert np.all((again[spec.index] == 0) | np.isclose(again[spec.index], 1.0)), (
                "residual counted twice"
            )
    finally:
        cluster.close()


def test_a_learner_that_starts_late_takes_the_push_phase_of_the_one_ahead():
    from decoupled_diloco.learner.schedule import Schedule

    schedule = Schedule(4, 8)  # fragment p due at (p + 1) * 2 mod 8
    schedule.align(0, 13.2)  # the other is at step 13: its next pushes at 14, 16, 18, 20
    assert schedule.next_due == [5, 7, 1, 3]
    assert [schedule.due(s) for s in range(1, 8)] == [[2], [], [3], [], [0], [], [1]]

    # Over gRPC: learner 1 hears from the syncer where learner 0 is, and its first step
    # takes learner 0's phase.
    config = _config(inner_steps=8, **{"decoupled.fragments": 4})
    cluster = _Cluster(config)
    try:
        (zero, _), (one, params) = cluster.join(0), cluster.join(1)
        zero.sync.client.heartbeat(learner_id=0, step=40, state="training", step_time_s=0.5)
        reply = one.sync.client.heartbeat(learner_id=1, step=0, state="training")
        assert reply.live_learners == 2
        assert 40 <= reply.lead_step < 44  # 40, and the time since over 0.5 s a step
        assert reply.lead_step_time_s == 0.5
        one.sync.schedule.hear_lead(40.0, 0.0)
        one.sync.step_done(params, 64)
        assert one.sync.schedule.next_due == [1 + 2, 1 + 4, 1 + 6, 1 + 8]  # as 40's: 42, 44...
        assert one.sync.schedule.shift == 39  # its heartbeats say phase step 1 + 39
        alone = one.sync.client.heartbeat(learner_id=0, step=41, state="training")
        assert alone.lead_step == -1.0  # learner 1 has no step time yet: none to follow
        # A learner already aligned is followed by its phase, not its own count; a claim of
        # tiny steps is extrapolated at most 10 rounds (H = 8).
        one.sync.client.heartbeat(
            learner_id=1, step=5, phase_step=44, state="training", step_time_s=5e-324
        )
        lead = zero.sync.client.heartbeat(learner_id=0, step=41, state="training").lead_step
        assert lead == 44 + 10 * 8
    finally:
        cluster.close()


def test_steps_of_several_units_before_a_covered_position_never_reach_a_push():
    # A constant global batch: a step trains several ledger units. Lease 0 comes back with
    # fragment 0's pushes holding units 0..5: the steps over them are not counted, the next
    # push holds the units after, and its outer gradient counts from θ at unit 6.
    config = _config(
        inner_steps=4,
        train_steps=20,
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 2,
            "decoupled.data_shards": 4,
            "decoupled.global_batch": "constant",
        },
    )
    cluster = _Cluster(config)
    try:
        zero, params = cluster.join(0)
        state = cluster.server.state
        state.register(1, "1x1")  # a second learner that never pushes: no round closes
        grant = zero.sync.client.lease(0)
        assert (grant.lease, grant.begin, grant.end, grant.live_learners) == (0, 0, 80, 2)
        zero.sync.lease_started(0, 0, [6])
        zero.sync.step_done(_shift(params, -0.25), 64, data=[[0, 0, 3]])
        zero.sync.step_done(_shift(params, -0.5), 64, data=[[0, 3, 6]])  # θ at the covered end
        zero.sync.step_done(_shift(params, -0.6), 3 * 32, data=[[0, 6, 9]])  # 32 tokens a row
        zero.sync.step_done(_shift(params, -0.75), 5 * 32, data=[[0, 9, 14]])  # step 4: a push
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's push")
        pending = cluster.fragment(0).pending[0]
        assert (pending.steps, pending.tokens, pending.data) == (2, 8 * 32, [[0, 6, 14]])
        for delta in state.pending_gradient(0, 0):
            np.testing.assert_allclose(delta, 0.25, rtol=1e-5)
    finally:
        cluster.close()


def test_steps_refused_as_covered_never_reach_a_later_push():
    # Lease 0 was handed to learner 1 while learner 0, its first holder, was only slow: both
    # trained its first batches. Learner 1's push of them is taken; learner 0's is refused as
    # covered, and learner 0's next push holds only what it trained after the refusal.
    config = _config(
        inner_steps=4,
        train_steps=20,
        num_learners=3,
        **{"decoupled.fragments": 1, "decoupled.quorum": 3, "decoupled.data_shards": 4},
    )
    cluster = _Cluster(config)
    try:
        (zero, params0), (one, params1) = cluster.join(0), cluster.join(1)
        state = cluster.server.state
        state.register(2, "1x1")  # a third learner that never pushes: no round closes
        assert zero.sync.client.lease(0).lease == 0
        state.ledger.take(0, 1)  # handed again, to learner 1
        for i in range(4):
            one.sync.step_done(_shift(params1, -0.25), 64, data=(0, i))
        _wait(lambda: 1 in cluster.fragment(0).pending, "learner 1's push")
        for i in range(4):
            zero.sync.step_done(_shift(params0, -0.5), 64, data=(0, i))
        _wait(
            lambda: _ended(zero.sync) and zero.sync.counters.pushes["covered"] == 1, "the refusal"
        )
        zero.sync.step_done(_shift(params0, -0.5), 64, data=(0, 4))  # dropped: a hole
        for i in range(5, 8):  # steps 6-8; the step at 8 pushes
            zero.sync.step_done(_shift(params0, -0.75), 64, data=(0, i))
        _wait(lambda: 0 in cluster.fragment(0).pending, "learner 0's next push")
        pending = cluster.fragment(0).pending[0]
        assert (pending.steps, pending.data) == (3, [[0, 5, 8]])
        # Its outer gradient is the last steps' 0.25, not the 0.75 since the anchor.
        for delta in state.pending_gradient(0, 0):
            np.testing.assert_allclose(delta, 0.25, rtol=1e-5)
        report = state.ledger.report(
            [[r for x in cluster.fragment(0).pending.values() for r in x.data]]
        )
        assert report["repeated"] == 0
    finally:
        cluster.close()


def test_a_rebased_push_counts_batches_trained_again_since_once():
    # Batches handed back and trained again before a late push's merge came are left out of
    # its rebased ranges (clipped, not dropped whole), with their share of steps and tokens.
    from decoupled_diloco.learner.fragment import rebased
    from decoupled_diloco.learner.round_trip import Late

    late = Late(steps=10, tokens=640, data=[[0, 0, 10]], reference=[])
    assert rebased(late, [[0, 4, 6]]) == (8, 512, [[0, 0, 4], [0, 6, 10], [0, 4, 6]])
    assert rebased(late, [[1, 0, 3]]) == (10, 640, [[0, 0, 10], [1, 0, 3]])
    assert rebased(late, [[0, 10, 12]]) == (10, 640, [[0, 0, 12]])  # contiguous: one range
    assert rebased(late, [[0, 0, 10]]) == (0, 0, [[0, 0, 10]])


def _held_bytes(root):
    """Bytes of the distinct array buffers reachable from `root` through our own objects."""
    seen, buffers = set(), {}

    def walk(o):
        if id(o) in seen or isinstance(o, (str, bytes, int, float, type(None))):
            return
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            buffers[o.__array_interface__["data"][0]] = o.nbytes
        elif isinstance(o, jax.Array):
            buffers[o.unsafe_buffer_pointer()] = o.nbytes
        elif isinstance(o, dict):
            for v in list(o.values()):
                walk(v)
        elif isinstance(o, (list, tuple, set)):
            for v in list(o):
                walk(v)
        elif type(o).__module__.startswith(("decoupled_diloco", "concurrent")):
            for v in list(getattr(o, "__dict__", {}).values()):
                walk(v)

    walk(root)
    return sum(buffers.values())


def test_a_finished_round_trip_holds_no_copy_of_the_fragment_or_of_its_old_anchor():
    # Issue 20: every fragment's last push was kept with θ's host copy and the anchor it was
    # taken against, 2x the model beside θ and the anchor (a 1B learner was killed for memory).
    config = _config(
        inner_steps=8,
        **{"decoupled.fragments": 2, "decoupled.quorum": 1, "decoupled.keep_overlap": True},
    )
    cluster = _Cluster(config)
    try:
        learner, params = cluster.join(0)
        sync = learner.sync
        model = sum(x.nbytes for x in _leaves(sync, params))
        _steps(sync, _shift(params, -0.25), 8)  # both fragments pushed (after steps 4 and 8)
        _wait(lambda: _back(sync) == {0: 1, 1: 1}, "both merges")
        params = sync.apply_arrivals(_shift(params, 0.25))
        sync.step_done(params, 64)
        # θ (the last step's parameters) and the anchor: nothing else stays.
        assert _held_bytes(sync) <= 2 * model + 4096, _held_bytes(sync) / model
    finally:
        cluster.close()
