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

One fragment's round trip: when fragment p is due (staggered schedule, `core.fragments`),
`step_done` copies its tensors to the host (or encodes Δ on the mesh, `core.compression`) and a
worker thread pushes Δ = anchor_p − θ_p (`core.outer.Difference`, computed a chunk at a time
as it streams; retried
through outages, `outbox.Outbox`), waits for the merge that holds it and leaves the merged values
in the inbox. `apply_arrivals` merges them into the live parameters (`core.outer.merge_back`) at
the first step boundary at least τ (`overlap_steps`) steps after the push (or on arrival,
`apply_on_arrival`); they become the new anchor. The loop never waits for the syncer (unless
`decoupled.wait_for_merge`: synchronous DiLoCo across the syncer). (The
push's two halves are functions of the link in `learner.push`; its heartbeats and summary are
in `learner.progress`.)

What arrives is host numpy; it is put onto the learner's own mesh, so learners with different
mesh shapes share one syncer. A multi-process island (`multihost`) replaces the device<->host
hooks (`_to_host`, `_place`, `_take_ready`) by collectives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax
import numpy as np

from decoupled_diloco import runtime
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import fragments as F
from decoupled_diloco.learner import mesh_merge, progress, push
from decoupled_diloco.learner.encoder import MeshEncoder
from decoupled_diloco.learner.inbox import Inbox
from decoupled_diloco.learner.outbox import Outbox
from decoupled_diloco.learner.round_trip import Inbound, Outgoing, Trip
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
    """

    aligns = True  # may take a learner ahead's push phase (`decoupled.align_phase`)
    rebases = True  # keeps the work of a push refused as late (`Inbound.late`)

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
        self.config, self.id, self.client, self.mesh_name = config, learner_id, client, mesh_name
        self.on_state = on_state
        self.on_trip: Callable[[Trip], None] | None = None  # each round trip (`learner.metrics`)
        self.task_fingerprint = task.fingerprint(F.tensor_specs(abstract_params))
        self._given = params  # what `__enter__` joins with
        self._initial: Params = None  # the global values `__enter__` joined, for the first call
        self._last: Params = None  # the parameters of the last `step_done`, for the exit flush
        d = config.decoupled
        self.specs = F.tensor_specs(abstract_params)
        self.cut = F.partition(self.specs, d.fragments)
        self.treedef = jax.tree.structure(abstract_params)
        # The parameters' device memory is the host's (CPU): `device_get` returns views.
        self.host_is_device = all(
            d.platform == "cpu" for s in jax.tree.leaves(shardings) for d in s.device_set
        )
        self.shardings = self.treedef.flatten_up_to(shardings)
        num = len(self.cut)
        self.outbox = Outbox(num, d.syncer.max_unsent, f"learner {learner_id}")
        self.anchor: list[list[np.ndarray]] = [[] for _ in range(num)]
        self.versions = [0] * num
        self.steps_since = [0] * num
        self.tokens_since = [0] * num
        self.rounds = [0] * num
        self.waits = [-1] * num  # per fragment, the round of the push whose merge is awaited
        # Per fragment, the leased batches trained since its last push ([lease, begin, end)s;
        # `syncer.ledger`): they go with the push.
        self.data_since: list[list[list[int]]] = [[] for _ in range(num)]
        # A lease handed again (`lease_started`): per fragment, (lease, position) up to which
        # its pushes already hold the batches; the fragment's outer gradient then counts from
        # θ after that position (`origin`, a host copy) instead of from its anchor.
        self.skip: dict[int, tuple[int, int]] = {}
        # Learners training now, as the syncer last said (heartbeat and lease replies; 0: not
        # heard yet): a constant global batch is split by it (`config.units_per_step`).
        self.live = 0
        self.origin: list[list[np.ndarray] | None] = [None] * num
        # Fragments whose last push the syncer refused as "covered" (its data is in the global
        # model already): the next step drops what they trained since and counts from θ then.
        self.covered: set[int] = set()
        # When each fragment is due (`learner.schedule`: staggered, every H or DyLU's H).
        self.schedule = Schedule(num, config.inner_steps, d.dynamic_local_updates)
        self.last_push = [-1] * num  # per fragment, the step of its last (non-final) push
        # Fragments due while their last round trip was under way (`push.under_way`), and how
        # many pushes were held so: the link is behind, each fragment syncs less often than H.
        self.held: set[int] = set()
        self.deferred = 0
        self.rebased = 0  # late pushes whose work went with a later push (`push.rebase`)
        self.paused_at: float | None = None  # the current pause's first poll (`push.pause`)
        # keep_overlap: per fragment, a device copy of θ at its last push.
        self.at_push: dict[int, list[jax.Array]] = {}
        self.inbox = Inbox()
        # Per fragment: undelivered pushes retrying through an outage, and one waiting pull.
        self.pool = futures.ThreadPoolExecutor(max_workers=num * (d.syncer.max_unsent + 1) + 1)
        self.trips: dict[int, futures.Future] = {}  # per fragment, its last push's round trip
        self.jobs: dict[int, Outgoing] = {}  # and that push
        self.stop = threading.Event()
        self.heartbeats = progress.Heartbeats(self)  # started by `connect` (or `join`)
        # Progress, as heartbeats report it.
        self.step = self.tokens = 0
        self.loss: Any = float("nan")
        self.eval_loss = float("nan")  # learners do not evaluate; the launcher evaluates Θ
        self.blocked_s = self.sync_host_s = self.compress_s = 0.0
        self.errors: list[str] = []
        self.retries = 0  # this link's own retries of pushes and pulls (the client adds its)
        self.pushes = {"accepted": 0, "late": 0, "duplicate": 0, "covered": 0}
        self.round_log: list[dict[str, int]] = []  # bytes per push round (summary, metrics)
        # Per applied merge: the push it answers and the step it was applied after (the lag is
        # how many steps trained away from the merged value).
        self.applied: list[dict[str, int]] = []
        # Outer-gradient compression on this mesh, with its error-feedback residual.
        self.encoder = MeshEncoder(config, self.cut, abstract_params, shardings)

    # Joining ---------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 120.0, peers_s: float = 60.0) -> None:
        """Waits for the syncer, registers, and takes the current global fragments.

        In a fresh run (every fragment still at version 0) it also waits up to `peers_s` for
        all learners to register, so that they start together and their pushes of a round
        arrive close enough for the grace window to merge them. A learner joining a run in
        progress never waits.
        """
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
        for p in range(len(self.cut)):
            version, values = self.client.pull(
                self.id, p, 0, self.config.decoupled.syncer.rpc_timeout_s
            )
            self.anchor[p], self.versions[p] = values, version

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
        # (With DyLU each learner's H follows its speed: no common phase to take.)
        self.schedule.resume(step, d.align_phase and self.aligns and not d.dynamic_local_updates)
        leaves = self.treedef.flatten_up_to(params)
        for p, frag in enumerate(self.cut):
            for spec, value in zip(frag, self.anchor[p], strict=True):
                leaves[spec.index] = self._place(value, self.shardings[spec.index])
        params = jax.tree.unflatten(self.treedef, leaves)
        if self.encoder.enabled:  # compile every fragment's encoder now, not in the step loop
            self.encoder.warm_up(self.anchor, leaves)
        residual = self.encoder.residual_leaves() if self.config.compression.keep_unsent else None
        mesh_merge.warm_up(self.cut, leaves, residual, d.keep_overlap, d.alpha)
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
            push.wait_for_due_merges(self)
        ready = self._take_ready()
        self.blocked_s += time.perf_counter() - t0
        return self._merge(params, ready, donate=True)

    def _merge(self, params: Params, ready: dict[int, Inbound], donate: bool = False) -> Params:
        """`params` with the `ready` merged fragments merged back (`apply_arrivals`).

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
        # As in `_launch`: the dispatched steps that produce these values finish outside the
        # timer (with one device the loop may run a whole round ahead of the compute).
        jax.block_until_ready([leaves[s.index] for p in ready for s in self.cut[p]])
        t0 = time.perf_counter()
        d = self.config.decoupled
        # keep_unsent: the residual moves into the parameters when the merge answering the
        # push that left it arrives (the next push then must not add it again).
        residual = None
        if self.config.compression.keep_unsent:
            residual = self.encoder.residual_leaves()
        for p, inbound in ready.items():
            # A merge answering an older push than the last one is overwritten as is: the
            # overlap and the residual it would keep belong to the newer push.
            latest = inbound.pushed_at == self.last_push[p]
            at_push = self.at_push.pop(p, None) if d.keep_overlap else None
            unsent = residual is not None and latest
            if push.rebasable(self, p, inbound):  # rebased: every step since its reference
                at_push, unsent = push.rebase(self, p, inbound.late), False
            merged = [
                self._place(v, self.shardings[x.index])
                for x, v in zip(self.cut[p], inbound.values, strict=True)
            ]
            mesh_merge.merge_into(
                leaves,
                self.cut[p],
                merged,
                at_push if latest else None,
                residual if unsent else None,
                d.alpha,
                donate,
            )
            self.encoder.in_params[p] = unsent
            self.anchor[p], self.versions[p] = inbound.values, inbound.version
            self.origin[p] = None  # the outer gradient counts from the new anchor
            self.applied.append(
                dict(
                    fragment=p,
                    version=inbound.version,
                    pushed_at=inbound.pushed_at,
                    applied_at=self.step,
                )
            )
        self.sync_host_s += time.perf_counter() - t0
        params = jax.tree.unflatten(self.treedef, leaves)
        if donate and self._last is not None:  # (its merged fragments' buffers were donated)
            self._last = params
        return params

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
        self.paused_at = None
        self.step += 1
        self.tokens += tokens
        self._last = params
        if loss is not None:
            self.loss = loss
        for p in range(len(self.cut)):
            if p in self.covered:  # its refused steps (and this one) must not reach a push
                self.covered.discard(p)
                push.restart_count(self, params, p)
                continue
            skipped = p in self.skip and [r for r in ranges if r[0] == self.skip[p][0]]
            if skipped:  # covered data: not counted
                if max(r[2] for r in skipped) >= self.skip[p][1]:  # covered to here: from θ
                    del self.skip[p]
                    leaves = F.gather(self.treedef.flatten_up_to(params), self.cut[p])
                    self.origin[p] = self._to_host(leaves)
                continue
            self.steps_since[p] += 1
            self.tokens_since[p] += tokens
            since = self.data_since[p]
            for lease, begin, end in ranges:
                if since and since[-1][0] == lease and since[-1][2] == begin:
                    since[-1][2] = end
                else:
                    since.append([lease, begin, end])
        self.schedule.step_finished(self.step)
        push.push_due(self, params, self.schedule.due(self.step))

    def lease_started(self, lease: int, begin: int, covered: list[int]) -> None:
        """A lease (handed again) starts at `begin`; fragment p's pushes hold it to covered[p].

        Until then fragment p counts none of the steps (they would be pushed twice); after
        the step at covered[p] − 1 its outer gradient is taken from θ then, not its anchor.
        """
        for p, until in enumerate(covered):
            if until > begin:
                self.skip[p] = (lease, until)

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
        push.flush(self, self._last if params is None else params, final=True)
        return time.perf_counter() - t0

    def pause(self) -> bool:
        """One poll of a leased learner's wait for a lease: whether it is settled (`push.pause`)."""
        return push.pause(self, self._initial if self._initial is not None else self._last)

    def close(self) -> None:
        """Stops the background work, tells the syncer this learner is done, closes the client."""
        self.stop.set()
        if self.heartbeats.started:
            self.heartbeats.join()
            self._heartbeat("done")
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # Checkpoints -----------------------------------------------------------------------------

    def checkpoint_items(self) -> dict[str, Any]:
        """This link's state pytrees for an Orbax checkpoint, by name (the EF residual)."""
        residual = self.encoder.residual
        return {} if residual is None else {"ef_residual": residual}

    def restore_items(self, items: dict[str, Any]) -> None:
        """Takes back what `checkpoint_items` saved."""
        if "ef_residual" in items:
            self.encoder.residual = items["ef_residual"]

    def summary(self) -> dict[str, Any]:
        """This link's counters for the learner's summary (`progress.summary`)."""
        return progress.summary(self)

    # Device <-> host (a multi-process island replaces these by collectives) ------------------

    def _take_ready(self) -> dict[int, Inbound]:
        """Removes and returns the merged fragments whose overlap has passed."""
        return self.inbox.take_ready(self.step)

    def _to_host(self, leaves: list[jax.Array]) -> list[np.ndarray]:
        """Host copies of device arrays."""
        return [np.asarray(x) for x in jax.device_get(leaves)]

    def _place(self, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """A host value onto this learner's devices."""
        return jax.device_put(value, sharding)

    # One push (`learner.push`) ---------------------------------------------------------------

    def _launch(self, params: Params, p: int, final: bool = False) -> None:
        """Hands fragment p's push to a worker thread (its host copy or encoding made here)."""
        push.launch(self, params, p, final)

    def _under_way(self, p: int) -> bool:
        """Fragment p's last round trip has not ended (`push.under_way`)."""
        return push.under_way(self, p)

    def _retried(self) -> None:
        self.retries += 1

    def _sync(self, job: Outgoing) -> None:
        """Background: one fragment's round trip (`push.sync`); its merge goes to the inbox."""
        push.sync(self, job)

    def _on_covered(self, p: int) -> None:
        """A push of p was refused as covered: the next step restarts p's count."""
        self.covered.add(p)

    # Heartbeats (`learner.progress`; the thread is `self.heartbeats`) ------------------------

    def _heartbeat(self, state: str) -> None:
        """Sends one heartbeat (`progress.Heartbeats.send`); `multihost`: its leader only."""
        self.heartbeats.send(state)
