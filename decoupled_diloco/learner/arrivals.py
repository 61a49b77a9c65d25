"""Merges back from the syncer, merged into the live parameters at a step boundary.

A `DecoupledSync` applies what its round trips brought back (`learner.inbox`) through one
`Arrivals`: each merged fragment is put onto the learner's mesh and merged into θ
(`mesh_merge.merge_into`: the global values, plus the progress since the push with
`keep_overlap`, plus the compression residual with `keep_unsent`), and becomes the fragment's
anchor. A merge answering a push refused as late is rebased: θ keeps every step since the
refused push's reference, and its counts and data go with the next push.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.learner import mesh_merge
from decoupled_diloco.learner.bridge import HostBridge
from decoupled_diloco.learner.encoder import MeshEncoder
from decoupled_diloco.learner.fragment import FragmentState
from decoupled_diloco.learner.progress import SyncCounters
from decoupled_diloco.learner.round_trip import Inbound

Params = Any


class Arrivals:
    """Merges ready fragments into parameters (see the module doc); its parts are the link's.

    Args:
      config: the experiment (`decoupled.alpha`, `keep_overlap`, `compression.keep_unsent`).
      partition: each fragment's tensors.
      treedef: the parameter tree's structure.
      shardings: each leaf's sharding on the learner's mesh (flat, in leaf order).
      states: each fragment's state, shared with the link.
      counters: the link's counters (`applied`, `rebased`, `sync_host_s`).
      encoder: outer-gradient compression (its residual and which fragments' it holds).
      bridge: puts host values onto the mesh.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        partition: list[list[TensorSpec]],
        treedef: Any,
        shardings: list[jax.sharding.Sharding],
        states: list[FragmentState],
        counters: SyncCounters,
        encoder: MeshEncoder,
        bridge: HostBridge,
    ):
        self.config, self.partition, self.treedef = config, partition, treedef
        self.shardings, self.states, self.counters = shardings, states, counters
        self.encoder, self.bridge = encoder, bridge

    def merge(
        self, params: Params, ready: dict[int, Inbound], step: int, donate: bool = False
    ) -> Params:
        """`params` with the `ready` merged fragments merged back, applied after `step`.

        `donate`: the merged fragments' buffers in `params` are reused (`apply_arrivals`, whose
        caller trains on what it returns); else `params` stays as it was (a pause, whose
        parameters the step loop still holds).
        """
        if not ready:
            return params
        leaves = self.treedef.flatten_up_to(params)
        # One array in two leaves (a step that returns aliased outputs) cannot be donated for
        # one of them and still be read for the other: such a tree is merged without donating.
        donate = donate and len({id(x) for x in leaves}) == len(leaves)
        # As in a push: the dispatched steps that produce these values finish outside the
        # timer (with one device the loop may run a whole round ahead of the compute).
        jax.block_until_ready([leaves[s.index] for p in ready for s in self.partition[p]])
        t0 = time.perf_counter()
        d = self.config.decoupled
        # keep_unsent: the residual moves into the parameters when the merge answering the
        # push that left it arrives (the next push then must not add it again).
        residual = None
        if self.config.compression.keep_unsent:
            residual = self.encoder.residual_leaves()
        for p, inbound in ready.items():
            state = self.states[p]
            # A merge answering an older push than the last one is overwritten as is: the
            # overlap and the residual it would keep belong to the newer push.
            latest = inbound.pushed_at == state.last_push
            at_push, state.at_push = (state.at_push if d.keep_overlap else None), None
            unsent = residual is not None and latest
            if state.rebasable(inbound):  # rebased: every step since its reference is kept
                at_push, unsent = self._rebase(p, inbound), False
            mesh_merge.merge_into(
                leaves,
                self.partition[p],
                self._placed(p, inbound.values),
                at_push if latest else None,
                residual if unsent else None,
                d.alpha,
                donate,
            )
            self.encoder.in_params[p] = unsent
            state.anchored(inbound)
            self.counters.applied.append(
                dict(
                    fragment=p,
                    version=inbound.version,
                    pushed_at=inbound.pushed_at,
                    applied_at=step,
                )
            )
        self.counters.sync_host_s += time.perf_counter() - t0
        return jax.tree.unflatten(self.treedef, leaves)

    def _rebase(self, p: int, inbound: Inbound) -> list[jax.Array]:
        """Fragment p's push refused as late: its counts and data go with the next push.

        Returns what the current values are applied against (`merge_back`'s `at_push`): the
        refused push's reference, so that θ keeps all the progress since it and the next push's
        Δ (from the current values) holds the refused steps too. A compressed push's
        error-feedback residual of p is zeroed: it counted the refused push as sent (without
        `keep_unsent` the remainder it held from earlier pushes is lost with it; with it, θ
        holds that already).
        """
        late = inbound.late
        self.states[p].rebase(late)
        self.counters.rebased += 1
        self.encoder.forget(p)
        return self._placed(p, late.reference)

    def _placed(self, p: int, values: list[Any]) -> list[jax.Array]:
        """Host values of fragment p's tensors, on the learner's mesh."""
        return [
            self.bridge.place(v, self.shardings[x.index])
            for x, v in zip(self.partition[p], values, strict=True)
        ]
