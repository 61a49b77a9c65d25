"""Learners in-process against a real syncer on 127.0.0.1: schedule, DyLU, merge-back."""

import threading
import time

import jax
import numpy as np
import pytest

from decoupled_diloco.core import fragments as F
from decoupled_diloco.learner.loop import Learner
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config

TOKEN = "learner-test"


def _config(**overrides):
    return tiny_config(mode="decoupled", **{"decoupled.syncer.token": TOKEN, **overrides})


def test_schedule_matches_the_staggered_rule_and_dynamic_h_scales_with_speed():
    config = _config(inner_steps=8, **{"decoupled.fragments": 4})
    learner = Learner(config, 0, "127.0.0.1:1", devices=jax.devices()[:1], mesh_shape=(1, 1))
    for step in range(1, 3 * 8 + 1):
        assert learner.due(step) == F.due_fragments(step, 4, 8)
    assert learner.local_h() == 8
    dylu = Learner(
        _config(inner_steps=8, **{"decoupled.dynamic_local_updates": True}),
        1,
        "127.0.0.1:1",
        devices=jax.devices()[:1],
        mesh_shape=(1, 1),
    )
    dylu.fastest_step_s, dylu.step_time_s = 0.1, 0.3
    assert dylu.local_h() == 2  # floor(8 * 0.1 / 0.3)
    dylu.fastest_step_s, dylu.step_time_s = 0.1, 0.1
    assert dylu.local_h() == 8


def test_two_learners_with_alpha_mixing_and_different_meshes_exchange_fragments(corpus):
    config = _config(
        train_steps=24,
        inner_steps=4,
        **{"eval.every": 0, "decoupled.alpha": 0.5, "outer.merge": "rda"},
    )
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
        for r in results.values():
            assert r["steps"] == 24 and not r["errors"] and np.isfinite(r["final_loss"])
            assert r["pushes"]["accepted"] >= 6 and max(r["versions"]) >= 1
        deadline = time.monotonic() + 30  # the last rounds close within the syncer's next tick
        while any(f["pending"] for f in server.state.status()["fragments"]):
            assert time.monotonic() < deadline, server.state.status()["fragments"]
            time.sleep(0.02)
        status = server.state.status()
        assert status["merges"] >= 6
        assert {m for rec in status["merge_log"] for m in rec["learners"]} == {0, 1}
    finally:
        server.stop(0)


def test_a_push_waits_for_the_merge_that_holds_it_not_for_an_older_one():
    config = _config(
        **{
            "decoupled.fragments": 1,
            "decoupled.quorum": 1,
            "decoupled.overlap_steps": 2,
            "decoupled.grace_safety": 0.5,
        }
    )
    server = SyncerServer(config, host="127.0.0.1", port=0).start()
    learners = []
    try:
        server.state.ema_step.update(1.0)  # grace window 0.5 * 2 steps * 1 s = 1 s
        address = f"127.0.0.1:{server.port}"
        for i in (0, 1):
            learners.append(
                Learner(config, i, address, devices=jax.devices()[i : i + 1], mesh_shape=(1, 1))
            )
            learners[i].connect(peers_s=0)
        host = [np.asarray(x) - 0.25 for x in learners[0].anchor[0]]  # θ: anchor − 0.25
        # Learner 1's push of version 0 merges alone once its grace window has passed.
        learners[1]._sync(0, 0, 0, learners[1].anchor[0], host, 4, 64, True, 4)
        deadline = time.monotonic() + 30
        while server.state.fragments[0].version < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Learner 0's push, still anchored at version 0, joins the next round (version 2):
        # what comes back must hold it, not be version 1, merged before it arrived.
        learners[0].rounds[0] = 1  # as `_launch` leaves it: round 0 is the newest push of 0
        sync = threading.Thread(
            target=learners[0]._sync, args=(0, 0, 0, learners[0].anchor[0], host, 4, 64, False, 4)
        )
        sync.start()
        sync.join(timeout=60)  # a pull waiting for a version that never comes fails, not hangs
        learners[0].stop.set()
        sync.join()
        inbound = learners[0].inbox[0]
        assert inbound.version == 2 == server.state.fragments[0].version
        assert server.state.merge_log[-1]["learners"] == [0]
        for got, want in zip(inbound.values, server.state.fragments[0].values, strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        for learner in learners:
            learner.stop.set()
            learner.client.close()
        server.stop(0)


@pytest.mark.parametrize("on_arrival", [False, True])
def test_a_merge_waits_tau_steps_unless_applied_on_arrival_and_its_lag_is_logged(on_arrival):
    config = _config(
        inner_steps=8,
        **{
            "decoupled.fragments": 1,
            "decoupled.overlap_steps": 5,
            "decoupled.apply_on_arrival": on_arrival,
        },
    )
    server = SyncerServer(config, host="127.0.0.1", port=0).start()
    address = f"127.0.0.1:{server.port}"
    learner = Learner(config, 0, address, devices=jax.devices()[:1], mesh_shape=(1, 1))
    try:
        learner.connect(peers_s=0)
        state = learner.island.init(0)
        host = [np.asarray(x) - 0.25 for x in learner.anchor[0]]
        learner.rounds[0] = learner.last_push[0] = 1  # as `_launch` leaves it
        # The only live learner pushed: the round closes at once and the merge comes back.
        learner._sync(0, 0, 0, learner.anchor[0], host, 4, 64, False, 1)
        assert learner.inbox[0].apply_after_step == (1 if on_arrival else 6)
        learner.step = 3  # two steps after the push: applied only on arrival
        learner._apply_arrivals(state)
        assert learner.versions[0] == (1 if on_arrival else 0)
        learner.step = 6
        learner._apply_arrivals(state)
        assert learner.versions[0] == 1 and learner.inbox == {}
        lag = 2 if on_arrival else 5
        assert learner.applied == [
            {"fragment": 0, "version": 1, "pushed_at": 1, "applied_at": 1 + lag}
        ]
    finally:
        learner.stop.set()
        learner.client.close()
        server.stop(0)


def test_keep_overlap_keeps_the_steps_trained_while_a_fragment_was_in_flight():
    from decoupled_diloco.learner.link import Inbound

    config = _config(inner_steps=8, **{"decoupled.fragments": 2, "decoupled.keep_overlap": True})
    learner = Learner(config, 0, "127.0.0.1:1", devices=jax.devices()[:1], mesh_shape=(1, 1))
    state = learner.island.init(0)
    learner.step = 10
    learner._launch(state, 0)  # fragment 0 pushed at step 10: θ_at_push recorded
    learner.stop.set()  # no syncer here: the background push gives up at once
    [job.result() for job in learner.jobs]
    at_push = [np.asarray(x) for x in learner.at_push[0]]
    # The overlap steps' progress: every parameter moved by +0.5.
    state = type(state)(jax.tree.map(lambda x: x + 0.5, state.params), state.opt_state)
    merged = [np.full(s.shape, 2.0, s.dtype) for s in learner.cut[0]]
    other = [np.full(s.shape, -1.0, s.dtype) for s in learner.cut[1]]
    learner.step = 12
    learner.inbox = {0: Inbound(1, merged, 12, pushed_at=10), 1: Inbound(1, other, 12, 3)}
    leaves = learner.treedef.flatten_up_to(learner._apply_arrivals(state).params)
    for j, spec in enumerate(learner.cut[0]):  # merged + (θ_now − θ_at_push) = 2 + 0.5
        np.testing.assert_allclose(np.asarray(leaves[spec.index]), 2.0 + 0.5, rtol=1e-6)
        assert at_push[j].shape == spec.shape
    for spec in learner.cut[1]:  # answers no recorded push: overwritten
        np.testing.assert_allclose(np.asarray(leaves[spec.index]), -1.0)
    assert learner.at_push == {} and learner.versions == [1, 1]


def test_keep_unsent_moves_the_residual_into_the_parameters_when_its_merge_arrives():
    from decoupled_diloco.learner.link import Inbound

    z = {
        "compression.scheme": "topk",
        "compression.density": 0.02,
        "compression.topk_values": "none",
    }
    z |= {"compression.error_feedback": True, "compression.keep_unsent": True}
    config = _config(inner_steps=8, **{"decoupled.fragments": 2, **z})
    learner = Learner(config, 0, "127.0.0.1:1", devices=jax.devices()[:1], mesh_shape=(1, 1))
    state = learner.island.init(0)
    leaves = learner.treedef.flatten_up_to(state.params)
    for p, frag in enumerate(learner.cut):  # anchor = θ + 1: every outer gradient entry is 1
        learner.anchor[p] = [np.asarray(leaves[s.index]) + 1.0 for s in frag]
    learner.step = 10
    learner._launch(state, 0)  # top-k sends a few entries; the residual keeps the rest
    learner._launch(state, 1)
    learner.stop.set()
    [job.result() for job in learner.jobs]
    residual = [np.asarray(x) for x in learner.treedef.flatten_up_to(learner.ef_residual)]
    for spec in learner.cut[0] + learner.cut[1]:
        kept = residual[spec.index]
        assert 0 < np.count_nonzero(kept) < kept.size
        assert np.all((kept == 0) | np.isclose(kept, 1.0))
    merged = [np.full(s.shape, 2.0, s.dtype) for s in learner.cut[0]]
    other = [np.full(s.shape, -1.0, s.dtype) for s in learner.cut[1]]
    learner.step = 12
    learner.inbox = {0: Inbound(1, merged, 12, pushed_at=10), 1: Inbound(1, other, 12, 3)}
    state = learner._apply_arrivals(state)
    new = learner.treedef.flatten_up_to(state.params)
    after = [np.asarray(x) for x in learner.treedef.flatten_up_to(learner.ef_residual)]
    for spec in learner.cut[0]:  # θ ← merged − residual; the buffer keeps it for checkpoints
        np.testing.assert_allclose(np.asarray(new[spec.index]), 2.0 - residual[spec.index])
        np.testing.assert_array_equal(after[spec.index], residual[spec.index])
    for spec in learner.cut[1]:  # answers an older push: overwritten, the residual waits
        np.testing.assert_allclose(np.asarray(new[spec.index]), -1.0)
        np.testing.assert_array_equal(after[spec.index], residual[spec.index])
    assert learner.unsent_in_params == [True, False]
    # The next push of fragment 0: Δ = anchor − θ = residual, which must not be added again.
    learner.step = 20
    learner._launch(state, 0)
    [job.result() for job in learner.jobs]
    again = [np.asarray(x) for x in learner.treedef.flatten_up_to(learner.ef_residual)]
    for spec in learner.cut[0]:
        kept = again[spec.index]
        assert np.count_nonzero(kept) < np.count_nonzero(residual[spec.index])
        assert np.all((kept == 0) | np.isclose(kept, 1.0)), "residual counted twice"
    assert learner.unsent_in_params == [False, False]
