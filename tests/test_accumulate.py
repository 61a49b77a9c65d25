"""The syncer's folded merge (issue 20): the same result as the stacked outer round, flat memory.

`core.outer.outer_round` (what the `diloco` trainer runs, all M outer gradients at once) is the
reference; the syncer folds each push as it arrives and corrects capped, held-back and
superseded ones when the round closes. Through the server, pushes live in the push store
(files), not in memory, and the files go once nothing can need them.
"""

import pathlib

import numpy as np
import optax
import pytest

from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.core import accumulate, outer
from decoupled_diloco.syncer.records import Push
from decoupled_diloco.syncer.server import SyncerServer, initial_fragments
from decoupled_diloco.syncer.state import SyncerState
from tests.conftest import tiny_config
from tests.helpers import wait_until

TOKEN = "accumulate-test-token"


def _config(**overrides):
    base = {
        "num_learners": 4,
        "decoupled.fragments": 2,
        "decoupled.quorum": 4,
        "decoupled.syncer.max_grace_s": 0.0,
        "outer.merge": "rda",
    }
    return tiny_config(mode="decoupled", **{**base, **overrides})


def _deltas(specs, seed, scale=1e-2):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(s.shape)).astype(np.float32) for s in specs]


def _reference(config, specs, values, pushes, mean_only, averaged):
    """outer.outer_round on the stacked outer gradients, with the capped shares as weights."""
    o = config.outer
    tx = outer.make_outer_optimizer(o.lr, o.momentum, o.nesterov, o.delayed_nesterov)
    tree = lambda xs: {s.name: np.asarray(x) for s, x in zip(specs, xs, strict=True)}  # noqa: E731
    weights = [outer.token_weight(tokens, steps) for _, steps, tokens in pushes]
    shares = outer.bounded_shares(weights, config.decoupled.syncer.max_weight_share)
    scale = len(pushes) / config.num_learners  # partial_merge "share"
    new, _ = outer.outer_round(
        tx,
        o.merge,
        {s.name: mean_only(s.name) for s in specs},
        tree(values),
        tx.init(tree(values)),
        [tree(d) for d, _, _ in pushes],
        shares,
        scale,
        averaged={s.name: averaged(s.name) for s in specs},
    )
    return [np.asarray(new[s.name]) for s in specs]


def test_round_sum_is_the_stacked_merge():
    rng = np.random.default_rng(0)
    shapes, plain = [(30, 7), (50,), (3, 4, 5)], [False, True, False]
    deltas = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    weights = [1.0, 2.5, 0.7]
    rounds = accumulate.RoundSum([int(np.prod(s)) for s in shapes], plain)
    for d, w in zip(deltas, weights, strict=True):
        rounds.fold(d, w / sum(weights))
    extra = [rng.standard_normal(s).astype(np.float32) for s in shapes]  # folded, taken out
    rounds.fold(extra, 0.4)
    rounds.fold(extra, -0.4)
    got = rounds.finish(0.5)
    tree = lambda d: {str(i): a for i, a in enumerate(d)}  # noqa: E731
    want = outer.merge([tree(d) for d in deltas], weights, "rda", tree(plain))
    for i, s in enumerate(shapes):
        np.testing.assert_allclose(got[i].reshape(s), 0.5 * want[str(i)], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        "plain",  # token weights within range, no cap binding
        "capped",  # one push's share is cut to max_weight_share
        "held",  # weights 10^6 apart: the small one is held back, added at close
        "equal",  # k * cap <= 1: equal shares, every push read back
        "superseded",  # a learner's second push replaces its first
        "mean",  # outer.merge "mean"
    ],
)
def test_the_folded_merge_is_the_stacked_outer_round(case):
    overrides = {
        "capped": {"decoupled.syncer.max_weight_share": 0.5},
        "equal": {
            "decoupled.syncer.max_weight_share": 0.3,
            "num_learners": 3,
            "decoupled.quorum": 3,
        },
        "mean": {"outer.merge": "mean"},
    }.get(case, {})
    config = _config(**overrides)
    cut, values = initial_fragments(config)
    mean_only = lambda name: "embed" in name  # noqa: E731
    averaged = lambda name: name.endswith("attn_norm/scale")  # noqa: E731 - as batch statistics
    state = SyncerState(config, cut, values, is_mean_only=mean_only, is_averaged=averaged)
    m = config.num_learners
    for i in range(m):
        state.register(i, "")
    specs, before = cut[0], [v.copy() for v in state.fragments[0].values]
    counters = {  # (steps, tokens) per learner
        "plain": [(4, 1024), (4, 2048), (8, 1024), (2, 512)],
        "capped": [(4, 1024), (4, 8192), (4, 1024), (4, 1024)],
        "held": [(1, 1), (4, 4096), (4, 2048), (4, 1024)],
        "equal": [(4, 1024), (4, 3000), (4, 100)],
        "superseded": [(4, 1024), (4, 2048), (8, 1024), (2, 512)],
        "mean": [(4, 1024), (4, 2048), (8, 1024), (2, 512)],
    }[case]
    pushes = []
    for i, (steps, tokens) in enumerate(counters):
        delta = _deltas(specs, seed=i)
        if case == "superseded" and i == 1:
            state.push(Push(i, 0, 0, 0, steps, tokens, _deltas(specs, seed=99)))
            state.push(Push(i, 0, 1, 0, steps, tokens, delta))  # supersedes: counters add up
            steps, tokens = 2 * steps, 2 * tokens
        else:
            state.push(Push(i, 0, 0, 0, steps, tokens, delta))
        pushes.append((delta, steps, tokens))
    frag = state.fragments[0]
    assert frag.version == 1 and frag.refused_merges == 0
    if case == "held":
        assert state.merge_log[-1]["learners"] == list(range(m))
    want = _reference(config, specs, before, pushes, mean_only, averaged)
    for got, ref, spec in zip(frag.values, want, specs, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=spec.name)


def test_shares_and_factor_keep_equal_weights_proportional():
    """A lone push (or equal weights) needs no read-back: its share is factor x weight."""
    assert outer.shares_and_factor([5.0], 0.8) == ([1.0], 0.2)
    shares, factor = outer.shares_and_factor([2.0, 2.0, 2.0], 0.3)
    assert shares == [1 / 3] * 3 and factor == pytest.approx(1 / 6)
    assert outer.shares_and_factor([1.0, 3.0, 2.0], 0.3) == ([1 / 3] * 3, 0.0)


def test_a_merge_that_fails_half_way_drops_its_round_and_the_next_one_merges(monkeypatch):
    """A push that cannot be read back while the round closes: the round is dropped, the
    fragment stays as it was (no half-scaled sums are merged later), the next round merges."""
    from decoupled_diloco.syncer import payloads

    config = _config(**{"decoupled.syncer.max_weight_share": 0.5, "decoupled.quorum": 3})
    cut, values = initial_fragments(config)
    state = SyncerState(config, cut, values)
    for i in range(4):
        state.register(i, "")
    specs, before = cut[0], [v.copy() for v in state.fragments[0].values]
    frag = state.fragments[0]
    state.push(Push(0, 0, 0, 0, 4, 1024, _deltas(specs, 0)))
    state.push(Push(1, 0, 0, 0, 4, 8192, _deltas(specs, 1)))  # capped: read back at close
    unreadable = frag.pending[1].parts[0][1]
    real = payloads.Payload.tensors
    monkeypatch.setattr(
        payloads.Payload,
        "tensors",
        lambda self, check=False: iter([None]) if self is unreadable else real(self, check),
    )
    state.push(Push(2, 0, 0, 0, 4, 1024, _deltas(specs, 2)))  # quorum: the round closes
    assert frag.version == 0 and frag.refused_merges == 1 and not frag.pending
    assert frag.round is None
    for got, want in zip(frag.values, before, strict=True):
        np.testing.assert_array_equal(got, want)
    monkeypatch.setattr(payloads.Payload, "tensors", real)
    pushes = [(_deltas(specs, 5 + i), 4, 1024) for i in range(2)]
    pushes.append((_deltas(specs, 4), 4, 1024))
    for i, (delta, steps, tokens) in enumerate(pushes):
        state.push(Push(i, 0, 1, 0, steps, tokens, delta))
    assert frag.version == 1
    want = _reference(config, specs, before, pushes, lambda n: False, lambda n: False)
    for got, ref in zip(frag.values, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_an_open_round_holds_one_buffer_and_the_pushes_stay_in_files(tmp_path):
    """Through the server: no push is kept in memory; files go when nothing needs them."""
    config = _config(**{"decoupled.syncer.snapshot_s": 0.0})
    for durable in (False, True):
        server = SyncerServer(
            config,
            host="127.0.0.1",
            port=0,
            token=TOKEN,
            checkpoint_dir=str(tmp_path / "ckpt") if durable else None,
        ).start()
        client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
        try:
            for i in range(4):
                client.register(i, server.fingerprint)
            specs = server.state.fragments[0].specs
            for i in range(3):  # quorum 4: the round stays open
                reply = client.push(
                    learner_id=i,
                    fragment=0,
                    round=0,
                    base_version=0,
                    steps=4,
                    tokens=1024,
                    specs=specs,
                    arrays=_deltas(specs, i),
                )
                assert reply.accepted
            frag, store = server.state.fragments[0], server.state.store
            with server.state.lock:
                parts = [payload for x in frag.pending.values() for _, payload in x.parts]
                assert len(parts) == 3 and frag.round is not None
                assert all(x.data is None and x.arrays is None and x.path for x in parts)
                first_round = sorted(pathlib.Path(x.path) for x in parts)
                assert sorted(store.directory.glob("*.push")) == first_round
            client.push(
                learner_id=3,
                fragment=0,
                round=0,
                base_version=0,
                steps=4,
                tokens=1024,
                specs=specs,
                arrays=_deltas(specs, 3),
            )
            assert client.pull(0, 0, 1, wait_s=30)[0] == 1
            if durable:  # released once a snapshot after the merge is the oldest kept one
                keep = config.checkpoint.max_to_keep
                for rnd in range(1, keep + 2):  # more merges, more snapshots
                    for i in range(4):
                        client.push(
                            learner_id=i,
                            fragment=1,
                            round=rnd,
                            base_version=rnd - 1,
                            steps=4,
                            tokens=1024,
                            specs=server.state.fragments[1].specs,
                            arrays=_deltas(server.state.fragments[1].specs, i),
                        )
                    assert client.pull(0, 1, rnd, wait_s=30)[0] == rnd
                    seq = server.state.seq  # one snapshot after each merge
                    done = lambda s=seq, c=server.committer: c.snapshot_seq >= s  # noqa: E731
                    wait_until(done, 60, "a snapshot after the merge")
            # Merged: its files are gone (durable: once no kept snapshot predates the merge).
            gone = lambda files=first_round: not any(p.exists() for p in files)  # noqa: E731
            wait_until(gone, 60, "files purged")
        finally:
            client.close()
            server.stop(0)
        if not durable:
            assert not store.directory.exists()  # the temporary store is removed


def test_a_snapshot_holds_arrays_that_later_merges_never_write(tmp_path):
    """Snapshots are written without copies: a merge must install new arrays (values, outer
    momentum), never write into ones a snapshot may still be writing; and what is written
    reads back as it was when the snapshot was taken."""
    from decoupled_diloco.checkpointing import IslandCheckpointer
    from decoupled_diloco.syncer.durability import snapshot

    config = _config(**{"decoupled.quorum": 2, "outer.momentum": 0.9})
    cut, values = initial_fragments(config)
    state = SyncerState(config, cut, values)
    for i in range(2):
        state.register(i, "")
    specs = cut[0]
    for rnd in range(2):
        for i in range(2):
            state.push(Push(i, 0, rnd, rnd, 4, 1024, _deltas(specs, 10 * rnd + i)))
    tree, meta, _ = snapshot(state)
    held = [np.array(x) for x in tree["f0"]["values"] + tree["f0"]["opt"]]
    for i in range(2):  # a third merge, after the snapshot was taken
        state.push(Push(i, 0, 2, 2, 4, 1024, _deltas(specs, 20 + i)))
    assert state.fragments[0].version == 3
    for got, want in zip(tree["f0"]["values"] + tree["f0"]["opt"], held, strict=True):
        np.testing.assert_array_equal(got, want)
    n = len(tree["f0"]["values"])
    moved = [
        not np.array_equal(a, b) for a, b in zip(state.fragments[0].values, held[:n], strict=True)
    ]
    assert any(moved)  # (the merge did change the fragment, elsewhere)
    checkpointer = IslandCheckpointer(tmp_path, immutable_host_arrays=True)
    try:
        checkpointer.save(meta["seq"], tree, meta)
        checkpointer.wait()
        restored, restored_meta = checkpointer.restore(meta["seq"], None)
    finally:
        checkpointer.close()
    assert restored_meta["seq"] == meta["seq"]
    for got, want in zip(restored["f0"]["values"] + restored["f0"]["opt"], held, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    # ‖Θ‖, the admission bounds' scale, travels with the snapshot (a merge replayed after a
    # restore then meets the bounds it met when it ran); where one is recorded it is taken as is.
    from decoupled_diloco.syncer.durability import load

    want = np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in held[:n]))
    np.testing.assert_allclose(meta["fragments"]["0"]["norm"], want, rtol=1e-6)
    restored_meta["fragments"]["0"]["norm"] *= 1.001
    fresh = SyncerState(config, cut, values)
    load(fresh, restored, restored_meta)
    assert fresh.fragments[0].version == 2
    assert fresh.fragments[0].norm() == restored_meta["fragments"]["0"]["norm"]


@pytest.mark.parametrize("nesterov, delayed", [(True, 0), (False, 4)])
def test_flat_step_is_optax_in_new_values_and_steps_its_state_in_place_unless_viewed(
    nesterov, delayed
):
    """`FlatStep` is optax's step on the vector (averaged ranges: Θ − g), its new values are a
    read-only vector of their own (installed values are never written), and it steps the
    optimizer state in place except while numpy views of it are held, as a snapshot being
    written holds them: then those arrays stay as they were."""
    import jax

    from decoupled_diloco.core import host

    size, averaged = (1 << 16) + 7, [(10, 20)]
    tx = outer.make_outer_optimizer(0.7, 0.9, nesterov, delayed)
    step = accumulate.FlatStep(tx, size, averaged)
    want_state = tx.init({"flat": np.zeros(size, np.float32)})
    state = step.init()
    assert [x.shape for x in state] == step.shapes()
    assert {d.platform for x in state for d in x.devices()} == {"cpu"}  # the host's memory
    assert [x.shape for x in state] == [x.shape for x in jax.tree.leaves(want_state)]
    rng = np.random.default_rng(0)
    params = host.aligned_copy(rng.standard_normal(size).astype(np.float32))
    for i in range(3):
        grads = host.aligned_copy(rng.standard_normal(size).astype(np.float32) * 1e-2)
        updates, want_state = tx.update({"flat": grads}, want_state, {"flat": params})
        want = np.asarray(optax.apply_updates({"flat": params}, updates)["flat"]).copy()
        want[10:20] = params[10:20] - grads[10:20]
        vectors = [x for x in state if np.ndim(x)]
        was = [np.array(x) for x in vectors]
        pointers = [x.unsafe_buffer_pointer() for x in vectors]
        held = [np.asarray(x) for x in vectors] if i == 1 else []  # a snapshot's views
        before = params.copy()
        new, state, step_sq, new_sq = step(params, state, grads)
        np.testing.assert_array_equal(params, before)
        assert not new.flags.writeable and new.ctypes.data != params.ctypes.data
        np.testing.assert_allclose(new, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(step_sq, np.sum((new - params) ** 2.0), rtol=1e-4)
        np.testing.assert_allclose(new_sq, np.sum(new.astype(np.float64) ** 2), rtol=1e-4)
        for a, b in zip(jax.tree.leaves(want_state), state, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
        vectors = [x for x in state if np.ndim(x)]
        in_place = [x.unsafe_buffer_pointer() == q for x, q in zip(vectors, pointers, strict=True)]
        if held:
            assert not any(in_place)
            for j, old in enumerate(was):
                np.testing.assert_array_equal(held[j], old)  # what the snapshot writes
            del held
        elif jax.default_backend() == "cpu":
            assert all(in_place)
        params = new


def test_a_rounds_sums_on_the_host_device_become_the_new_values_memory():
    """A round's sums that XLA owns (written through a numpy view) are donated to the outer
    step, whose new values then take their memory: a close allocates no fragment-sized vector.
    The result is the same as from numpy sums, and the round's view is gone once taken."""
    from decoupled_diloco import runtime
    from decoupled_diloco.core import host

    size = 1000
    tx = outer.make_outer_optimizer(0.7, 0.9, True)
    step = accumulate.FlatStep(tx, size)
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(n).astype(np.float32) for n in (600, 400)]
    storage = runtime.xla_host_vector(size, step.device)
    rounds = accumulate.RoundSum([600, 400], [True, False], storage)
    assert rounds.owned is not None
    rounds.fold(deltas, 1.0)
    rounds.finish()
    where, sums = rounds.buffer.ctypes.data, rounds.buffer.copy()
    taken = rounds.take()
    assert rounds.buffer is None and rounds.owned is None
    params = host.aligned_copy(rng.standard_normal(size).astype(np.float32))
    new, _, step_sq, _ = step(params, step.init(), taken)
    assert new.ctypes.data == where  # the sums' memory
    want, _, want_sq, _ = step(params, step.init(), sums)  # numpy sums: left as they were
    np.testing.assert_array_equal(new, want)
    assert step_sq == want_sq and new.ctypes.data != want.ctypes.data


def test_aligned_host_vectors_are_read_in_place_and_never_written_by_a_donated_step():
    """What `core.host` relies on: XLA's CPU client aliases an aligned numpy vector, and a
    step that donates the aliasing array leaves the numpy memory as it was (learners place
    pulled values, their anchors, this way and then donate them to the inner step)."""
    import jax

    from decoupled_diloco.core import host

    for dtype in (np.float32, np.uint8):
        x = host.aligned_zeros(1000, dtype)
        assert x.ctypes.data % host.ALIGN_BYTES == 0 and x.shape == (1000,) and not x.any()
    x = host.aligned_copy(np.arange(1 << 16, dtype=np.float32).reshape(256, 256))
    assert x.ctypes.data % host.ALIGN_BYTES == 0 and x[-1] == (1 << 16) - 1
    placed = jax.device_put(x)
    if jax.default_backend() == "cpu":
        assert placed.unsafe_buffer_pointer() == x.ctypes.data  # read in place
    doubled = jax.jit(lambda v: v * 2.0, donate_argnums=0)(placed)
    np.testing.assert_array_equal(x, np.arange(1 << 16, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(doubled), 2.0 * x)
