"""The learner's side of the syncer protocol as one object: `DecoupledSync`.

A training loop (the built-in `Learner`, or a user's own) owns one. In a user's loop:

    with dd.DecoupledSync(config, learner_id=i, syncer="host:50051", params=params) as sync:
        for batch in loader:
            params = sync.apply_arrivals(params)        # the global values, then merged arrivals
            params, opt_state, loss = my_step(params, opt_state, batch)
            sync.step_done(params, tokens=n, loss=loss) # count it; push the fragments now due
    # leaving the block: the final flush, then close

The built-in `Learner` spells out what `with` does: `connect()` (register, take the global
fragments; heartbeats start), `join(params)` (start from them), the same two calls per step,
then `flush(params)` and `close()`.

One fragment's round trip (`learner.push.Pusher`): when fragment p is due (staggered schedule,
`core.fragments`), `step_done` copies its tensors to the host (or encodes Δ on the mesh,
`core.compression`) and a worker thread pushes Δ = anchor_p − θ_p (`core.outer.Difference`,
computed a chunk at a time as it streams; retried through outages, `outbox.Outbox`), waits for
the merge that holds it and leaves the merged values in the inbox. `apply_arrivals` merges them
into the live parameters (`core.outer.merge_back`) at the first step boundary at least τ
(`overlap_steps`) steps after the push (or on arrival, `apply_on_arrival`); they become the new
anchor. The loop never waits for the syncer (unless `decoupled.wait_for_merge`: synchronous
DiLoCo across the syncer).

The link is a facade over parts that own their state: each fragment's anchor and counts
(`learner.fragment.FragmentState`), the pushes and their round trips (`learner.push.Pusher`),
the counters and the heartbeats that report them (`learner.progress`), and the moves between
devices and host (`learner.bridge.HostBridge`). What arrives is host numpy; it is put onto the
learner's own mesh, so learners with different mesh shapes share one syncer. A multi-process
island passes a bridge that makes those moves collectives (`multihost.CollectiveBridge`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from decoupled_diloco import runtime
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import fragments
from decoupled_diloco.learner import mesh_merge
from decoupled_diloco.learner.arrivals import Arrivals
from decoupled_diloco.learner.bridge import Anchors, HostBridge, LocalBridge
from decoupled_diloco.learner.encoder import MeshEncoder
from decoupled_diloco.learner.fragment import FragmentState
from decoupled_diloco.learner.inbox import Inbox
from decoupled_diloco.learner.progress import Heartbeats, SyncCounters
from decoupled_diloco.learner.push import Pusher
from decoupled_diloco.learner.round_trip import Trip
from decoupled_diloco.learner.schedule import Schedule

Params = Any


class DecoupledSync:
    """A learner's link to the syncer (see the module doc for the calls a loop makes).

    Args:
      config: the experiment (`decoupled`, `compression` and `syncer` settings).
      learner_id: this learner's identity at the syncer (and its data shard).
      syncer: HOST:PORT of the syncer (of its shards: comma-separated); or give `client`.
      params: the parameter tree the loop trains (device arrays, or host arrays for the
        default device): its structure, shapes, dtypes and shardings; or give
        `abstract_params` and `shardings`.
      task: whose identity registration checks against the syncer's (`Task.fingerprint`);
        default: `make_task(config)` (`config.task`, or the built-in model).
      token: the run token or this learner's credential (default: config or `DD_RUN_TOKEN`).
      client: what `dd.syncer_client` returns (one client per syncer shard), instead of
        `syncer`.
      abstract_params: the parameter tree's shapes and dtypes, instead of `params`.
      shardings: the parameters' shardings on this learner's mesh (same tree).
      mesh_name: reported at registration, e.g. "2x1".
      on_state: called with "waiting" while `connect` waits (a timeline's `enter`).
      bridge: the island's device<->host moves (default: one process, `LocalBridge`).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        learner_id: int,
        syncer: str = "",
        params: Params = None,
        *,
        task: Any = None,
        token: str = "",
        client: Any = None,
        abstract_params: Params = None,
        shardings: Params = None,
        mesh_name: str = "",
        on_state: Callable[[str], None] | None = None,
        bridge: HostBridge | None = None,
    ):
        # Fragment-sized host buffers go back to the OS when freed (the learner process does
        # this first thing; here for a user's own loop, before the client's threads start).
        # It sets the process's malloc (`runtime.tune_malloc`), not only this object's.
        runtime.tune_malloc()
        if client is None:
            if not syncer:
                raise ValueError("DecoupledSync: give syncer='HOST:PORT' (or a client)")
            from decoupled_diloco.comm.shards import syncer_client

            client = syncer_client(syncer, config.decoupled.syncer, token)
        shards = len(getattr(client, "clients", [client]))  # a `ShardedClient` holds one per shard
        if shards != config.decoupled.syncer.shards:
            raise ValueError(
                f"DecoupledSync: client= talks to {shards} syncer shard(s), but "
                f"decoupled.syncer.shards={config.decoupled.syncer.shards}: make it with "
                "dd.syncer_client('HOST:PORT,...', config.decoupled.syncer, token), one address "
                "per shard"
            )
        if abstract_params is None:
            if params is None:
                raise ValueError("DecoupledSync: give params= (or abstract_params and shardings)")
            abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
            # Host arrays (numpy) go to the default device, as `jax.device_put` would put them.
            default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda x: getattr(x, "sharding", default), params)
        if task is None:
            from decoupled_diloco.tasks import make_task

            task = make_task(config)
        d = config.decoupled
        self.config, self.id, self.client, self.mesh_name = config, learner_id, client, mesh_name
        self.on_state = on_state
        self.on_trip: Callable[[Trip], None] | None = None  # each round trip (`learner.metrics`)
        self.bridge = bridge or LocalBridge()
        specs = fragments.tensor_specs(abstract_params)
        self.task_fingerprint = task.fingerprint(specs)
        self.partition = fragments.partition(specs, d.fragments)  # each fragment's tensors
        self.treedef = jax.tree.structure(abstract_params)
        self.shardings = self.treedef.flatten_up_to(shardings)
        self._given = params  # what `__enter__` joins with
        self._initial: Params = None  # what the next `apply_arrivals` returns (joined, paused)
        self._last: Params = None  # the parameters of the last `step_done`, for the exit flush
        num = len(self.partition)
        self.states = [FragmentState() for _ in range(num)]
        self.counters = SyncCounters()
        # When each fragment is due (`learner.schedule`: staggered, every H or DyLU's H).
        self.schedule = Schedule(num, config.inner_steps, d.dynamic_local_updates)
        self.inbox = Inbox()
        self.stop = threading.Event()
        # Outer-gradient compression on this mesh, with its error-feedback residual.
        self.encoder = MeshEncoder(config, self.partition, abstract_params, shardings)
        self.pusher = Pusher(
            config,
            learner_id,
            client,
            self.partition,
            self.treedef,
            self.states,
            self.counters,
            self.encoder,
            self.inbox,
            self.bridge,
            self.stop,
            # The parameters' device memory is the host's (CPU): `device_get` returns views.
            all(d.platform == "cpu" for s in self.shardings for d in s.device_set),
            # A pause's or the end's merges (the loop still holds those parameters: no donating).
            lambda params, ready: self.arrivals.merge(params, ready, self.step),
            lambda trip: self.on_trip is not None and self.on_trip(trip),
        )
        self.arrivals = Arrivals(
            config,
            self.partition,
            self.treedef,
            self.shardings,
            self.states,
            self.counters,
            self.encoder,
            self.bridge,
        )
        self.heartbeats = Heartbeats(  # started by `connect` (or `join`)
            client,
            learner_id,
            self.counters,
            self.schedule,
            lambda: self.versions,
            d.syncer.heartbeat_s,
            self.stop,
            self.bridge.talks,
        )

    # What a loop reads ----------------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Each fragment's version: of the global values it was last anchored at."""
        return [state.version for state in self.states]

    @property
    def step(self) -> int:
        """Inner steps done (a restored learner sets it in `join`)."""
        return self.counters.step

    @step.setter
    def step(self, value: int) -> None:
        self.counters.step = value

    @property
    def tokens(self) -> int:
        """Tokens trained on."""
        return self.counters.tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.counters.tokens = value

    @property
    def live(self) -> int:
        """Learners training now, as the syncer last said (0: not heard yet)."""
        return self.heartbeats.live

    @live.setter
    def live(self, value: int) -> None:
        self.heartbeats.live = value

    # Joining ---------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 120.0, peers_s: float = 60.0) -> None:
        """Waits for the syncer, registers, and takes the current global fragments.

        In a fresh run (every fragment still at version 0) it also waits up to `peers_s` for
        all learners to register, so that they start together and their pushes of a round
        arrive close enough for the grace window to merge them. A learner joining a run in
        progress never waits. (A multi-process island: its leader does, and tells the rest.)
        """
        anchors, versions = self.bridge.join(lambda: self._pull(timeout_s, peers_s), self.partition)
        for state, anchor, version in zip(self.states, anchors, versions, strict=True):
            state.anchor, state.version = anchor, version

    def _pull(self, timeout_s: float, peers_s: float) -> Anchors:
        """Registers, waits for peers in a fresh run, and pulls every global fragment."""
        self.client.wait_ready(timeout_s)
        reply = self.client.register(self.id, self.task_fingerprint, self.mesh_name)
        # Heartbeats from registration on: pulling the fragments, building the model and
        # compiling can outlast `learner_timeout_s`, and a learner silent that long counts as
        # gone (its data leases are handed to others).
        self.heartbeats.start()
        if self.on_state is not None:
            self.on_state("waiting")  # for peers (fresh run), then the global fragments
        deadline = time.monotonic() + peers_s
        while not any(reply.versions) and time.monotonic() < deadline:
            if len(self.client.status()["learners"]) >= self.config.num_learners:
                break
            time.sleep(0.05)
        pulled = [
            self.client.pull(self.id, p, 0, self.config.decoupled.syncer.rpc_timeout_s)
            for p in range(len(self.partition))
        ]
        return [values for _, values in pulled], [version for version, _ in pulled]

    def join(self, params: Params, step: int = 0, tokens: int = 0) -> Params:
        """The global values in place of `params`; starts heartbeats. Call after `connect`.

        Args:
          params: this learner's parameters (fresh, or restored from a checkpoint).
          step: the steps restored with them (0 for a fresh start): the schedule resumes
            from there; per-fragment counters start afresh (a new incarnation).
          tokens: the tokens restored with them.
        """
        self.step, self.tokens = step, tokens
        d = self.config.decoupled
        # (With DyLU each learner's H follows its speed: no common phase to take; a
        # multi-process island's processes would hear the lead's step at different times.)
        aligns = d.align_phase and self.bridge.alone and not d.dynamic_local_updates
        self.schedule.resume(step, aligns)
        leaves = self.treedef.flatten_up_to(params)
        anchors = [state.anchor for state in self.states]
        for frag, anchor in zip(self.partition, anchors, strict=True):
            for spec, value in zip(frag, anchor, strict=True):
                leaves[spec.index] = self.bridge.place(value, self.shardings[spec.index])
        params = jax.tree.unflatten(self.treedef, leaves)
        if self.encoder.enabled:  # compile every fragment's encoder now, not in the step loop
            self.encoder.warm_up(anchors, leaves)
        residual = self.encoder.residual_leaves() if self.config.compression.keep_unsent else None
        mesh_merge.warm_up(self.partition, leaves, residual, d.keep_overlap, d.alpha)
        runtime.trim_memory()  # what initialising the model and joining freed goes back now
        self.heartbeats.start()
        return params

    def __enter__(self) -> DecoupledSync:
        """Connects and joins with the `params` given.

        The first `apply_arrivals` returns them with the global values in place.
        """
        if self._initial is not None or self.heartbeats.started:
            raise RuntimeError("DecoupledSync: already entered")
        if self._given is None:
            raise ValueError("DecoupledSync: `with` needs the params= argument")
        self.connect()
        self._initial = self.join(self._given)
        self._given = None
        return self

    def __exit__(self, *exc: object) -> None:
        """Pushes what is left (the parameters of the last `step_done`), waits, and closes."""
        try:
            if self._last is not None and exc[0] is None:
                self.flush(self._last)
        finally:
            self.close()

    # The step loop's calls ---------------------------------------------------------------------

    def apply_arrivals(self, params: Params) -> Params:
        """Merges every fragment whose overlap has passed into `params` (see `merge_back`).

        Train on what it returns, as on a donated step's result: the merged fragments' arrays
        in `params` give their buffers to the new values and are deleted.
        """
        if self._initial is not None:  # the first call inside `with` (the joined global
            params, self._initial = self._initial, None  # values), or after a pause's merges
        t0 = time.perf_counter()
        if self.config.decoupled.wait_for_merge:
            self.pusher.wait_for_due_merges()
        ready = self.bridge.take_ready(
            lambda: self.inbox.take_ready(self.step), self.pusher.in_flight, self.partition
        )
        self.counters.blocked_s += time.perf_counter() - t0
        params = self.arrivals.merge(params, ready, self.step, donate=True)
        if ready and self._last is not None:  # (its merged fragments' buffers were donated)
            self._last = params
        if ready:
            leaves = self.treedef.flatten_up_to(params)
            for p in ready:
                merged = fragments.gather(leaves, self.partition[p])
                self.bridge.merged(self.step, p, self.states[p].version, merged)
        return params

    def _took(self, before: Params, after: Params) -> None:
        """After a pause's or the end's merges: the next `apply_arrivals` returns `after`."""
        if after is not before:
            self._initial = self._last = after

    def step_done(
        self,
        params: Params,
        tokens: int,
        loss: Any = None,
        data: tuple[int, int] | list[list[int]] | None = None,
    ) -> None:
        """Counts one finished inner step of `tokens` tokens; pushes the fragments now due.

        Args:
          params: the parameters after the step (device arrays; not modified).
          tokens: tokens the step trained on (all of this learner's devices together).
          loss: the step's loss (a device scalar is fine: read only by heartbeats).
          data: the ledger units the step trained on (`syncer.ledger`; the built-in
            learner's, see `learner.leases`): [[lease, begin, end), ...], or (lease, position)
            for one unit; or None. With a lease handed again, no range may straddle a
            fragment's `covered` position (`leases.leased_batches` cuts its steps there).
        """
        if self._initial is not None:
            raise RuntimeError(
                "DecoupledSync.step_done before the first apply_arrivals: train from the "
                "global values it returns (params = sync.apply_arrivals(params))"
            )
        if isinstance(data, tuple):  # one unit
            data = [[data[0], data[1], data[1] + 1]]
        ranges = data or []
        self.pusher.paused_at = None
        self.step += 1
        self.tokens += tokens
        self._last = params
        if loss is not None:
            self.counters.loss = loss
        for p, state in enumerate(self.states):
            if state.covered:  # its refused steps (and this one) must not reach a push
                state.covered = False
                self.pusher.restart_count(params, p)
                continue
            skipped = state.skipped(ranges)
            if skipped:  # the lease's covered steps are over: Δ counts from θ after them
                state.origin = self.pusher.host_copy(params, p)
            if skipped is None:
                state.count(tokens, ranges)
        self.schedule.step_finished(self.step)
        self.pusher.push_due(params, self.schedule.due(self.step))

    def lease_started(self, lease: int, begin: int, covered: list[int]) -> None:
        """A lease (handed again) starts at `begin`; fragment p's pushes hold it to covered[p].

        Until then fragment p counts none of the steps (they would be pushed twice); after
        the step at covered[p] − 1 its outer gradient is taken from θ then, not its anchor.
        """
        for state, until in zip(self.states, covered, strict=False):
            if until > begin:
                state.skip = (lease, until)

    def arrived(self) -> dict[int, int]:
        """Merged fragments that have arrived and wait for their step: fragment -> version."""
        return self.inbox.waiting()

    def flush(self, params: Params = None) -> float:
        """The run's end: pushes the steps since each fragment's last push; waits for delivery.

        `params`: the parameters now; default those of the last `step_done`. After a pause
        whose merges the loop has not taken yet (`apply_arrivals`), those parameters instead.

        Returns:
          Seconds it took. Pushes still undelivered after 2 × `rpc_timeout_s` are given up
          (`pushes_unsent` in the summary).
        """
        t0 = time.perf_counter()
        if self._initial is not None:  # what the next `apply_arrivals` returns: the latest
            params = self._initial
        params = self._last if params is None else params
        self._took(params, self.pusher.flush(params, final=True))
        return time.perf_counter() - t0

    def pause(self) -> bool:
        """One poll of a leased learner's wait for a lease: whether it is settled (`Pusher.pause`).

        The merges it applies are in what the next `apply_arrivals` returns.
        """
        params = self._initial if self._initial is not None else self._last
        settled, after = self.pusher.pause(params)
        self._took(params, after)
        return settled

    def close(self) -> None:
        """Stops the background work, tells the syncer this learner is done, closes the client."""
        self.stop.set()
        if self.heartbeats.started:
            self.heartbeats.join()
            self.heartbeats.send("done")
        self.pusher.close()
        self.client.close()

    # Checkpoints and summary -----------------------------------------------------------------

    def checkpoint_items(self) -> dict[str, Any]:
        """This link's state pytrees for an Orbax checkpoint, by name (the EF residual)."""
        residual = self.encoder.residual
        return {} if residual is None else {"ef_residual": residual}

    def restore_items(self, items: dict[str, Any]) -> None:
        """Takes back what `checkpoint_items` saved."""
        if "ef_residual" in items:
            self.encoder.residual = items["ef_residual"]

    def summary(self) -> dict[str, Any]:
        """This link's counters for the learner's summary (and its metrics)."""
        c, outbox = self.counters, self.pusher.outbox
        return {
            "versions": self.versions,
            "pushes": c.pushes,
            "pushes_folded": outbox.folded,
            "pushes_dropped": outbox.dropped,
            "pushes_unsent": outbox.unsent(),
            # Pushes held because the fragment's last round trip had not ended (a link behind).
            "pushes_deferred": c.deferred,
            # Pushes refused as late whose steps and data went with a later push (`_rebase`).
            "pushes_rebased": c.rebased,
            "retries": self.client.retries_done + c.retries,
            "errors": c.errors,
            # Traffic of the data calls, headers included (the initial pulls too).
            "bytes_sent": self.client.bytes_sent,
            "bytes_received": self.client.bytes_received,
            "compression": self.encoder.codec.scheme,
            "rounds": c.round_log,
            "applied": c.applied,
        }
