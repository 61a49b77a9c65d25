"""Fragments: balanced bin-packing and the staggered schedule (pure functions)."""

import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.core import fragments as F
from tests.conftest import tiny_config
from tests.helpers import is_due, sync_round


def _specs(sizes):
    return [F.TensorSpec(i, f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]


def test_partition_covers_every_tensor_once_and_is_balanced():
    sizes = [100, 90, 40, 40, 30, 20, 10, 5, 5, 1]
    bins = F.partition(_specs(sizes), 3)
    indices = sorted(s.index for b in bins for s in b)
    assert indices == list(range(len(sizes)))
    loads = [sum(s.nbytes for s in b) for b in bins]
    # Greedy LPT: the heaviest bin exceeds the ideal by at most the largest tensor.
    assert max(loads) - sum(loads) / 3 <= 4 * max(sizes)
    assert max(loads) / min(loads) < 1.2
    for b in bins:  # flatten order inside each fragment
        assert [s.index for s in b] == sorted(s.index for s in b)


def test_partition_is_deterministic_and_matches_the_greedy_rule():
    specs = _specs([8, 8, 4, 4, 2])
    # 8->f0, 8->f1, 4->f0 (tie: lowest index), 4->f1, 2->f0
    assert [[s.index for s in b] for b in F.partition(specs, 2)] == [[0, 2, 4], [1, 3]]
    assert F.partition(specs, 2) == F.partition(list(reversed(specs)), 2)


def test_partition_refuses_more_fragments_than_tensors():
    with pytest.raises(ValueError, match="fragments"):
        F.partition(_specs([1, 2]), 3)


def test_partition_of_the_real_model_and_fingerprint():
    import jax

    from decoupled_diloco.island import Island

    island = Island(tiny_config(), jax.devices()[:1])
    specs = F.tensor_specs(island.abstract_params)
    assert any(s.name.startswith("embed") for s in specs)
    bins = F.partition(specs, 3)
    assert all(bins) and sum(len(b) for b in bins) == len(specs)
    other = Island(tiny_config(**{"model.d_model": 64}), jax.devices()[:1])
    assert F.fingerprint(specs) != F.fingerprint(F.tensor_specs(other.abstract_params))
    assert F.fingerprint(specs) == F.fingerprint(F.tensor_specs(island.init(0).params))


@pytest.mark.parametrize("H,P", [(8, 1), (8, 4), (6, 6), (10, 3)])
def test_schedule_each_fragment_once_per_h_steps_staggered(H, P):
    steps = range(1, 3 * H + 1)
    due = {p: [t for t in steps if is_due(t, p, P, H)] for p in range(P)}
    for p, ts in due.items():
        assert len(ts) == 3 and np.all(np.diff(ts) == H)
        assert [sync_round(t, p, P, H) for t in ts] == [0, 1, 2]
    firsts = sorted(ts[0] for ts in due.values())
    assert len(set(firsts)) == P  # staggered: no two fragments share a step
    assert firsts[-1] == H  # the last fragment is due at H, like DiLoCo
    if P == 1:
        assert due[0] == [H, 2 * H, 3 * H]


def test_decoupled_config_validation_names_the_field():
    ok = tiny_config(mode="decoupled", **{"decoupled.fragments": 2})
    assert ok.decoupled.fragments == 2
    cases = {
        "decoupled.fragments": 5,  # > H = 4
        "decoupled.overlap_steps": 4,
        "decoupled.quorum": 3,
        "decoupled.alpha": 1.0,
        "decoupled.mesh_shapes": "1x1,zz",
        "decoupled.syncer.max_staleness": -1,
    }
    for field, value in cases.items():
        with pytest.raises(config_lib.ConfigError, match=f"config.{field}"):
            tiny_config(mode="decoupled", **{field: value})
    shapes = config_lib.parse_mesh_shapes(
        tiny_config(mode="decoupled", **{"decoupled.mesh_shapes": "1x1, 2x1"})
    )
    assert shapes == [(1, 1), (2, 1)]
