r"""A learner: inner steps on its own mesh; its `DecoupledSync` link syncs fragments meanwhile.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=127.0.0.1:50051 \
      --learner_id=0 --config=experiments/configs/tiny_lm.py --config.mode=decoupled

(flags: `__main__`, wiring: `cli`). The step loop is the island's jit-compiled inner step on
batches of the data leases the syncer hands this learner (or of its static shard: `leases`);
between steps it calls its link (`sync.DecoupledSync`): `apply_arrivals` before a step,
`step_done` after it. The link pushes each fragment's outer gradient when it is due, with the
leased batches it trained on, and merges the merged fragment back when it arrives; the loop
never waits for the syncer. `leave()` (SIGTERM) ends the loop at the next step: the learner
pushes what it trained and tells the syncer it is done, which hands its leases to others.
Checkpoints and (static shards) the data journal: `recovery`.
"""

from __future__ import annotations

import functools
import pathlib
import threading
import time
import types
from typing import Any

import jax
import numpy as np

from decoupled_diloco import planning, runtime
from decoupled_diloco.comm.faulty_link import DegradedLink
from decoupled_diloco.comm.retry import retry
from decoupled_diloco.comm.shards import syncer_client
from decoupled_diloco.config import (
    ExperimentConfig,
    data_leases,
    lease_unit,
    mesh_shape_for,
    units_per_step,
)
from decoupled_diloco.data.dataset import check_checkpointable, load_dataset
from decoupled_diloco.island import Island
from decoupled_diloco.learner import leases, recovery
from decoupled_diloco.learner.sync import DecoupledSync


class Learner:
    """One learner: an island, its data shard, and its link to the syncer (`self.sync`).

    Args:
      config: the experiment.
      learner_id: this learner's index (its data shard and identity at the syncer).
      address: HOST:PORT of the syncer, or of its S shards, comma-separated, shard 0 first.
      devices: this learner's devices (default: the first ones the mesh needs).
      mesh_shape: (`data`, `model`) axes; default from `decoupled.mesh_shapes` or `mesh.shape`.
      slowdown: >1 makes every step this many times slower (older hardware stand-in).
      token: the run token (default: config or `DD_RUN_TOKEN`).
      workdir: the run directory; with `checkpoint.every` > 0 the learner checkpoints into
        `workdir/checkpoints/learner_ID` and resumes from there (see `recovery`).
      island: a prebuilt island of this mesh (a warm standby's, see `standby`), else built here.
      timeline: where state changes are recorded (`obs.timeline.Timeline`), or None.
      controls: live fault controls (`chaos.faults.Controls`: slow-downs, a degraded link), or
        None.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        learner_id: int,
        address: str,
        devices: list[jax.Device] | None = None,
        mesh_shape: tuple[int, int] | None = None,
        slowdown: float = 1.0,
        token: str = "",
        workdir: str | pathlib.Path | None = None,
        island: Island | None = None,
        timeline: Any = None,
        controls: Any = None,
    ):
        t_construct = time.time()  # restart timing: imports are done by now
        self.config, self.id, self.slowdown = config, learner_id, slowdown
        # Data leases (`syncer.ledger`) or a static shard, and the rows of one ledger unit.
        self.leased, self.unit = data_leases(config), lease_unit(config)
        self.timeline, self.chaos = timeline, controls
        shape = mesh_shape or mesh_shape_for(config, learner_id, "")
        devices = devices or jax.devices()[: shape[0] * shape[1]]
        self.mesh_name = f"{shape[0]}x{shape[1]}"
        self.island = island or Island(config, devices, mesh_shape=shape)
        # Under a fault schedule the link to the syncer is degraded as the controls say.
        link = DegradedLink(controls, learner_id) if controls is not None else None
        self.sync = self._make_sync(syncer_client(address, config.decoupled.syncer, token, link))
        # Recovery (`recovery`): checkpoints and the data journal.
        self.checkpoints = (
            recovery.LearnerCheckpoints(
                pathlib.Path(workdir) / "checkpoints" / f"learner_{learner_id}",
                config.checkpoint.every,
                config.checkpoint.max_to_keep,
            )
            if workdir and config.checkpoint.every
            else None
        )
        self.data_position = self.skipped_batches = self.lost_steps = 0
        self.restarts = self.restored_from_step = 0
        self.startup: dict[str, float] = {"process_start": runtime.process_start_time()}
        self.startup["constructing"] = t_construct
        self._compiled: set[tuple] = set()  # batch shapes this process's step compiled for
        self.state = "starting"  # as the timeline names it (`obs.timeline.STATES`)
        self.leaving = threading.Event()  # `leave`: stop at the next step, flush, say done
        self.leases_trained: list[int] = []  # leases it trained on, in order (with leases)

    lease_ahead = True  # ask for the next lease in a thread (`leases.leased_batches`)
    settle_s = 30.0  # poll a pause this long between lease calls (`leases.leased_batches`)

    def _make_sync(self, client: Any, **extra: Any) -> DecoupledSync:
        """This learner's link (`extra`: more arguments of `DecoupledSync`, e.g. `bridge`)."""
        return DecoupledSync(
            self.config,
            self.id,
            task=self.island.task,
            client=client,
            abstract_params=self.island.abstract_params,
            shardings=self.island.param_sharding,
            mesh_name=self.mesh_name,
            on_state=self._mark,
            **extra,
        )

    # Progress lives in the link (heartbeats report it); checkpoints save and restore it here.

    @property
    def step(self) -> int:
        """Inner steps done."""
        return self.sync.step

    @step.setter
    def step(self, value: int) -> None:
        self.sync.step = value

    @property
    def tokens(self) -> int:
        """Tokens trained on."""
        return self.sync.tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.sync.tokens = value

    def checkpoint_items(self) -> dict[str, Any]:
        """State pytrees beyond the inner state, for the Orbax checkpoint (the EF residual)."""
        return self.sync.checkpoint_items()

    def restore_items(self, items: dict[str, Any]) -> None:
        """Takes back what `checkpoint_items` saved."""
        self.sync.restore_items(items)

    def connect(self, timeout_s: float = 120.0, peers_s: float = 60.0) -> None:
        """Registers with the syncer and takes the global fragments (`DecoupledSync.connect`)."""
        self.sync.connect(timeout_s, peers_s)

    def leave(self) -> None:
        """Asks the run to end at the next step boundary (a graceful leave: SIGTERM)."""
        self.leaving.set()

    def _lease_started(self, grant: Any) -> None:
        """A lease's first batch is drawn (`DecoupledSync.lease_started`)."""
        if not self.sync.live:  # (heartbeats say it later; a lease asked ahead is older)
            self.sync.live = getattr(grant, "live_learners", 0)
        self.sync.lease_started(grant.lease, grant.begin, list(grant.covered))

    def _ask(self, flushed: bool) -> Any:
        """One lease request (`SyncerClient.lease`), retried through a syncer outage."""
        reply = retry(
            lambda: self.sync.client.lease(self.id, flushed, retries=0), stop=self.leaving
        )
        return reply if reply is not None else types.SimpleNamespace(status="done")

    def _idle(self) -> bool:
        """No lease free yet: pushes everything trained so far; whether all of it is settled.

        Called on each poll of a wait for a lease until it answers True (`DecoupledSync.pause`).
        The timeline shows the learner blocked until its work is settled (pushing it is its
        own work, as the final flush is), then waiting; that time is `flush_since_step` (at the
        end, the final flush's).
        """
        if self._pause_t0 is None and self.state != "waiting":  # the pause's first poll
            self._mark("blocked", self.step)
            self._pause_t0 = time.perf_counter()
        settled = self.sync.pause()
        if settled and self._pause_t0 is not None:
            self.flush_since_step = time.perf_counter() - self._pause_t0
            self._pause_t0 = None
            self._mark("waiting", self.step)
        return settled

    def _mark(self, state: str, step: int = -1) -> None:
        """Records a state change (`self.state`), and in the timeline if any."""
        self.state = state
        if self.timeline is not None:
            self.timeline.enter(state, step)

    def _batch(self, batch: Any) -> Any:
        """A host batch as the inner step takes it (the island places host batches itself)."""
        return batch

    def run(self) -> dict[str, Any]:
        """Trains `train_steps` inner steps, then pushes what is left; returns a summary."""
        dataset, batches = self._data()
        state = self._start(batches)
        t_start = time.perf_counter()
        for step, (batch, where) in enumerate(self._source(dataset, batches), start=self.step + 1):
            state = self._train_step(state, step, batch, where, batches)
        train_wall = time.perf_counter() - t_start
        flush_s = self._finish(state)
        return self._summary(train_wall, flush_s)

    def _data(self) -> tuple[Any, Any]:
        """The dataset, and with static shards this learner's iterator (checkpointed with it).

        Raises:
          ValueError: a ledger unit that does not split over the data devices, or a learner
            joining beyond `num_learners` without data leases.
        """
        c = self.config
        dataset = load_dataset(c, task=self.island.task)  # the task's, or the config's data
        data_size = dict(self.island.mesh.shape).get("data", 1)
        if self.leased and self.unit % data_size:
            raise ValueError(
                f"learner {self.id}: a ledger unit of {self.unit} rows "
                f"(decoupled.lease_unit) cannot be split over its {data_size} data devices"
            )
        batches = None
        if not self.leased:
            if self.id >= c.num_learners:  # its static shard would be another learner's
                raise ValueError(
                    f"learner {self.id} cannot join a run of num_learners={c.num_learners} "
                    "static shards: joins need data leases (decoupled.data_shards > 0)"
                )
            batches = dataset.train_iterator(c.data.batch_size, self.id, c.num_learners, c.seed)
            if self.checkpoints is not None:
                check_checkpointable(batches, c)
        self.startup["data_loaded"] = time.time()
        return dataset, batches

    def _start(self, batches: Any) -> Any:
        """The island's state: restored (a restart) or fresh, then joined to the global values."""
        c = self.config
        planning.check_island(self.island)  # the state's shards fit, before any is allocated
        if self.checkpoints is not None:  # a restart resumes its checkpoint and data position
            self._mark("restoring")
            fresh = lambda: self.island.init(c.seed, self.id)  # noqa: E731
            state = self.checkpoints.restore(self, fresh, batches)
        else:
            state = self.island.init(c.seed, self.id)
        self.startup["restored"] = time.time()
        # Start (or rejoin) from the syncer's global values, pulled by `connect`.
        params = self.sync.join(state.params, self.step, self.tokens)
        # Flushing since the last step trained: at the end, the final flush (a leased learner
        # that finds no lease left flushes before it asks again: at the end that was the
        # final flush's pushing).
        self.flush_since_step = 0.0
        self._pause_t0: float | None = None  # when the current wait for a lease began
        return state._replace(params=params)

    def _source(self, dataset: Any, batches: Any) -> Any:
        """(batch, its ledger ranges or None) per step: from leases, or the static shard."""
        c = self.config
        if self.leased:
            per_step = functools.cache(lambda live: units_per_step(c, live))  # (per live count)
            return leases.leased_batches(
                dataset,
                self.unit,
                c.seed,
                self._ask,
                self._lease_started,
                self._idle,
                self.leaving,
                log=lambda line: print(f"[learner {self.id}] {line}", flush=True),
                ahead=self.lease_ahead,
                settle_s=self.settle_s,
                units_per_step=lambda: per_step(self.sync.live or c.num_learners),
            )
        return leases.static_batches(
            dataset,
            c.data.batch_size,
            self.id,
            c.num_learners,
            c.seed,
            c.train_steps - self.step,
            self.leaving,
            batches,
        )

    def _train_step(self, state: Any, step: int, batch: Any, where: Any, batches: Any) -> Any:
        """One inner step: arrivals merged in, the step, its count to the link, a checkpoint."""
        c, leased = self.config, self.leased
        last_step = -1 if leased else c.train_steps  # with leases: when the budget is covered
        for lease, _, _ in where or []:
            if lease not in self.leases_trained[-1:]:
                self.leases_trained.append(lease)
        state = state._replace(params=self.sync.apply_arrivals(state.params))
        first = not self._compiled  # this process's first step compiles
        # So does each new batch shape (a constant global batch's, `leases`): not slowed.
        shape = tuple(np.shape(x) for x in jax.tree.leaves(batch))
        compiling = shape not in self._compiled
        self._mark("compiling" if compiling else "stepping", step)
        t_step = time.perf_counter()
        if compiling:  # refused here, with what would fit, rather than out of memory
            planning.check_island(self.island, self._batch(batch))
        self.data_position += 1
        if self.checkpoints is not None and not leased:
            self.checkpoints.drew(self.data_position)  # before the step: see the data rule
        state, loss = self.island.step(state, self._batch(batch))
        slowdown = max(self.slowdown, self.chaos.slowdown() if self.chaos else 1.0)
        if slowdown > 1 or compiling:
            loss.block_until_ready()
            if not compiling:  # compiling is not slowed: only the steps of slower hardware
                time.sleep((slowdown - 1) * (time.perf_counter() - t_step))
        if first:
            self.startup["first_step"] = time.time()
            print(f"[learner {self.id}] {recovery.startup_line(self.startup)}", flush=True)
        self._compiled.add(shape)
        rows = c.data.batch_size if where is None else self.unit * sum(e - b for _, b, e in where)
        self.sync.step_done(state.params, self.island.task.tokens_per_step(rows), loss, data=where)
        self.flush_since_step, self._pause_t0 = 0.0, None
        if self.checkpoints is not None and self.checkpoints.due(step, last_step):
            # Dispatched steps finish first: their compute is stepping time, not saving.
            loss.block_until_ready()
            self._mark("checkpointing", step)
            self.checkpoints.save(self, state, batches)
        if step % c.log_every == 0 or step == last_step:
            print(
                f"[learner {self.id}] step {step}"
                f"{'' if leased else f'/{c.train_steps}'} loss {float(loss):.3f} "
                f"versions {self.sync.versions} "
                f"{self.sync.schedule.step_time_s * 1e3:.0f} ms/step",
                flush=True,
            )
        return state

    def _finish(self, state: Any) -> float:
        """The last checkpoint, then the final flush and close; the seconds the flush took."""
        jax.block_until_ready(state)  # (the last steps' compute is stepping time)
        if self.checkpoints is not None:
            # The last step's checkpoint is on disk before the flush, which may wait long on a
            # stopped or distant syncer: a learner killed then restarts after its last step.
            self._mark("checkpointing", self.step)
            if self.leased and self.step and not self.checkpoints.due(self.step, -1):
                self.checkpoints.save(self, state, None)  # (its last step is known only now)
            self.checkpoints.wait()
        if self._pause_t0 is not None:  # the budget was covered while a pause was settling
            self.flush_since_step = time.perf_counter() - self._pause_t0
        self._mark("blocked")  # the final flush
        flush_s = self.flush_since_step + self.sync.flush(state.params)
        self.sync.close()
        self._mark("done")
        if self.checkpoints is not None:
            self.checkpoints.close()
        return flush_s

    def _summary(self, train_wall: float, flush_s: float) -> dict[str, Any]:
        """This learner's summary (`learner_I.json`)."""
        s = self.sync.counters
        return {
            "learner_id": self.id,
            "mesh": self.mesh_name,
            "steps": self.step,
            "tokens": self.tokens,
            "train_wall_s": train_wall,
            "blocked_s": s.blocked_s,
            "sync_host_s": s.sync_host_s,
            "final_flush_s": flush_s,
            # Blocked on the syncer (the loop never waits for it; this measures that claim).
            "stall_fraction": s.blocked_s / max(train_wall, 1e-9),
            # Host copies of fragments and device puts of merged ones, done in the loop.
            "sync_host_fraction": s.sync_host_s / max(train_wall, 1e-9),
            "final_loss": float(s.loss),
            # Recovery (see `recovery`): restarts, the data rule.
            "restarts": self.restarts,
            "restored_from_step": self.restored_from_step,
            "data_position": self.data_position,
            "skipped_batches": self.skipped_batches,
            "lost_steps": self.lost_steps,
            "data": "leases" if self.leased else "static shard",
            "leases_trained": self.leases_trained,
            "left": self.leaving.is_set(),
            "checkpoint_save_s": self.checkpoints.save_s if self.checkpoints else 0.0,
            "startup": self.startup,
            # Encoding on the mesh, done in the step loop (inside `sync_host_s`).
            "compress_s": s.compress_s,
            "compress_fraction": s.compress_s / max(train_wall, 1e-9),
            **self.sync.summary(),
        }
