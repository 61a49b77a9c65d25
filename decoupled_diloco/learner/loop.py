r"""A learner process: inner steps on its own mesh, fragments synced in the background.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=127.0.0.1:50051 \
      --learner_id=0 --config=experiments/configs/tiny_lm.py --config.mode=decoupled

(flags: `learner_cli`). The step loop never waits for the syncer. When fragment p is due
(staggered schedule, see `fragments`), the loop copies its tensors to the host and hands them to
a background worker (`learner_link`), which computes the outer gradient Δ = anchor_p − θ_p,
pushes it, and then waits for the merged fragment. A merged fragment that has arrived is applied
at the next step boundary at least τ (`overlap_steps`) steps after its push (or on arrival,
`apply_on_arrival`): overwritten (`alpha` = 0) or mixed as α·local + (1 − α)·global. It becomes
the new anchor. What arrives is host numpy; the learner puts it onto its own mesh, so learners
with different mesh shapes share one syncer.
"""

from __future__ import annotations

import functools
import pathlib
import threading
import time
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco import runtime, tasks
from decoupled_diloco.chaos import faults as chaos
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.shards import syncer_client
from decoupled_diloco.config import ExperimentConfig, parse_mesh_shapes
from decoupled_diloco.core import compression
from decoupled_diloco.core import fragments as F
from decoupled_diloco.island import InnerState, Island
from decoupled_diloco.learner import recovery
from decoupled_diloco.learner.link import Encoded, Inbound, SyncerLink
from decoupled_diloco.obs.timeline import Timeline

_STEP_WINDOW = 10  # steps per measurement of this learner's step time


class Learner(SyncerLink):
    """One learner: an island, its data shard, per-fragment counters and a background syncer link.

    Args:
      config: the experiment.
      learner_id: this learner's index (its data shard and identity at the syncer).
      address: HOST:PORT of the syncer, or of its S shards, comma-separated, shard 0 first.
      devices: this learner's devices (default: the first ones the mesh needs).
      mesh_shape: (`data`, `model`) axes; default from `decoupled.mesh_shapes` or `mesh.shape`.
      slowdown: >1 makes every step this many times slower (older hardware stand-in).
      token: the run token (default: config or `DD_RUN_TOKEN`).
      workdir: the run directory; with `checkpoint.every` > 0 the learner checkpoints into
        `workdir/checkpoints/learner_ID` and resumes from there (see `learner_recovery`).
      island: a prebuilt island of this mesh (a warm standby's, see `standby`), else built here.
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
    ):
        t_construct = time.time()  # restart timing: imports are done by now
        self.config, self.id, self.slowdown = config, learner_id, slowdown
        shape = mesh_shape or parse_mesh_shapes(config)[learner_id]
        devices = devices or jax.devices()[: shape[0] * shape[1]]
        self.mesh_name = f"{shape[0]}x{shape[1]}"
        self.island = island or Island(config, devices, mesh_shape=shape)
        self.specs = F.tensor_specs(self.island.abstract_params)
        self.cut = F.partition(self.specs, config.decoupled.fragments)
        self.treedef = jax.tree.structure(self.island.abstract_params)
        self.shardings = self.treedef.flatten_up_to(self.island.param_sharding)
        self.client = syncer_client(address, config.decoupled.syncer, token)
        num = len(self.cut)
        # Recovery (`learner_recovery`): checkpoints and data journal, undelivered pushes.
        self.checkpoints = (
            recovery.LearnerCheckpoints(
                pathlib.Path(workdir) / "checkpoints" / f"learner_{learner_id}",
                config.checkpoint.every,
                config.checkpoint.max_to_keep,
            )
            if workdir and config.checkpoint.every
            else None
        )
        self.outbox = recovery.Outbox(
            num, config.decoupled.syncer.max_unsent, f"learner {learner_id}"
        )
        self.data_position = self.skipped_batches = self.lost_steps = 0
        self.restarts = self.restored_from_step = 0
        self.startup: dict[str, float] = {"process_start": runtime.process_start_time()}
        self.startup["constructing"] = t_construct
        self.anchor: list[list[np.ndarray]] = [[] for _ in range(num)]
        self.versions = [0] * num
        self.steps_since = [0] * num
        self.tokens_since = [0] * num
        self.rounds = [0] * num
        # Staggered schedule as "next due step" per fragment: o_p first, then every H steps
        # (or this learner's dynamic H, see `local_h`).
        self.next_due = [F.offset(p, num, config.inner_steps) for p in range(num)]
        self.fastest_step_s = 0.0
        self.inbox: dict[int, Inbound] = {}
        self.last_push = [-1] * num  # per fragment, the step of its last (non-final) push
        # keep_overlap: per fragment, a device copy of θ at its last push.
        self.at_push: dict[int, list[jax.Array]] = {}
        # keep_unsent: per fragment, whether θ already holds the residual (it stays in the
        # buffer too, so that a checkpoint keeps it: a restart starts θ from the global values).
        self.unsent_in_params = [False] * num
        self.inbox_lock = threading.Lock()
        # Per fragment: undelivered pushes retrying through an outage, and one waiting pull.
        self.pool = futures.ThreadPoolExecutor(
            max_workers=num * (config.decoupled.syncer.max_unsent + 1) + 1
        )
        self.jobs: list[futures.Future] = []
        self.stop = threading.Event()
        self.step = self.tokens = 0
        self.loss: Any = float("nan")
        self.eval_loss = float("nan")  # Learners do not evaluate; the launcher evaluates Θ.
        self.step_time_s = 0.0
        self.blocked_s = self.sync_host_s = 0.0
        self.errors: list[str] = []
        self.pushes = {"accepted": 0, "late": 0, "duplicate": 0}
        # Outer-gradient compression (`compression`): encoded on this mesh by one jit-compiled
        # function; with error feedback, `ef_residual` (a params-like pytree on this mesh, else
        # None) holds what was not sent yet. It is part of the checkpoint (`checkpoint_items`).
        z = config.compression
        self.codec = compression.codec_for(z)
        self.compressed = z.scheme != "none"
        self._encode = jax.jit(
            functools.partial(compression.encode_fragment, codec=self.codec, decay=z.ef_decay)
        )
        self.ef_residual: Any = None
        if z.error_feedback:
            self.ef_residual = jax.tree.map(
                lambda s, sharding: jax.device_put(np.zeros(s.shape, s.dtype), sharding),
                self.island.abstract_params,
                self.island.param_sharding,
            )
        self.compress_s = 0.0
        self.round_log: list[dict[str, int]] = []  # bytes per push round (summary, metrics)
        # Per applied merge: the push it answers and the step it was applied after (the lag is
        # how many steps trained away from the merged value).
        self.applied: list[dict[str, int]] = []
        # State timeline (goodput, see `timeline`) and live fault controls, when the launcher
        # set them up; None otherwise.
        self.timeline = Timeline.from_env(f"learner_{learner_id}", [learner_id])
        self.chaos = chaos.Controls.from_env(learner_id)
        self._compiled = False

    def _mark(self, state: str, step: int = -1) -> None:
        """Records a state change in the timeline (if any)."""
        if self.timeline is not None:
            self.timeline.enter(state, step)

    # Schedule --------------------------------------------------------------------------------

    def due(self, step: int) -> list[int]:
        """The fragments due after `step`; schedules each one's next push."""
        due = [p for p, at in enumerate(self.next_due) if step >= at]
        for p in due:
            self.next_due[p] = step + self.local_h()
        return due

    def local_h(self) -> int:
        """Inner steps until a pushed fragment is due again.

        H, or with dynamic local updates ⌊H · t_fastest / t_own⌋ (at least 1): a learner k times
        slower than the fastest syncs every H/k of its steps, i.e. as often in wall time.
        """
        H = self.config.inner_steps
        if not self.config.decoupled.dynamic_local_updates:
            return H
        if self.fastest_step_s <= 0 or self.step_time_s <= 0:
            return H
        return max(1, int(H * min(self.fastest_step_s / self.step_time_s, 1.0)))

    # Step loop -------------------------------------------------------------------------------

    # Hooks that a multi-process island (`multihost.MultihostLearner`) replaces by collectives.

    def _take_ready(self) -> dict[int, Inbound]:
        """Removes and returns the merged fragments whose overlap has passed."""
        with self.inbox_lock:
            ready = {p: x for p, x in self.inbox.items() if self.step >= x.apply_after_step}
            for p in ready:
                del self.inbox[p]
        return ready

    def _to_host(self, leaves: list[jax.Array]) -> list[np.ndarray]:
        """Host copies of device arrays."""
        return [np.asarray(x) for x in jax.device_get(leaves)]

    def _place(self, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """A host value onto this island's devices."""
        return jax.device_put(value, sharding)

    def _batch(self, tokens_BT1: np.ndarray) -> jax.Array | np.ndarray:
        """A host batch as the inner step takes it (the island places host batches itself)."""
        return tokens_BT1

    def _apply_arrivals(self, state: InnerState) -> InnerState:
        """Merges every fragment whose overlap has passed into the live parameters."""
        t0 = time.perf_counter()
        ready = self._take_ready()
        self.blocked_s += time.perf_counter() - t0
        if not ready:
            return state
        leaves = self.treedef.flatten_up_to(state.params)
        # As in `_launch`: the dispatched steps that produce these values finish outside the
        # timer (with one device the loop may run a whole round ahead of the compute).
        jax.block_until_ready([leaves[s.index] for p in ready for s in self.cut[p]])
        t0 = time.perf_counter()
        alpha = self.config.decoupled.alpha
        # keep_unsent: the residual moves into the parameters when the merge answering the
        # push that left it arrives (the next push then must not add it again).
        residual = None
        if self.config.compression.keep_unsent:
            residual = self.treedef.flatten_up_to(self.ef_residual)
        for p, inbound in ready.items():
            # A merge answering an older push than the last one is overwritten as is: the
            # overlap and the residual it would keep belong to the newer push.
            latest = inbound.pushed_at == self.last_push[p]
            # With keep_overlap: the local progress since the push this merge answers.
            at_push = self.at_push.pop(p, None)
            at_push = at_push if latest else None
            unsent = residual is not None and latest
            for j, (spec, value) in enumerate(zip(self.cut[p], inbound.values, strict=True)):
                placed = self._place(value, self.shardings[spec.index])
                local = leaves[spec.index]
                if at_push is not None:
                    placed = placed + (local - at_push[j])
                if unsent:  # the residual is in outer-gradient units: anchor − θ
                    placed = placed - residual[spec.index]
                leaves[spec.index] = placed if alpha == 0 else alpha * local + (1 - alpha) * placed
            self.unsent_in_params[p] = unsent
            self.anchor[p], self.versions[p] = inbound.values, inbound.version
            self.applied.append(
                {
                    "fragment": p,
                    "version": inbound.version,
                    "pushed_at": inbound.pushed_at,
                    "applied_at": self.step,
                }
            )
        self.sync_host_s += time.perf_counter() - t0
        return InnerState(jax.tree.unflatten(self.treedef, leaves), state.opt_state)

    def _launch(self, state: InnerState, p: int, final: bool = False) -> None:
        leaves = F.gather(self.treedef.flatten_up_to(state.params), self.cut[p])
        # Steps run ahead asynchronously: wait for them outside the timer, so that it measures
        # the copy itself and not the compute it would otherwise absorb.
        jax.block_until_ready(leaves)
        t0 = time.perf_counter()
        if not final:
            self.last_push[p] = self.step
        if self.config.decoupled.keep_overlap and not final:
            # A device copy: the next step donates these buffers.
            self.at_push[p] = [jnp.copy(x) for x in leaves]
        if self.compressed:
            local = self._compress(p, leaves)
            self.compress_s += time.perf_counter() - t0
        else:
            # A host copy now: the next step donates (invalidates) these device buffers.
            local = self._to_host(leaves)
        self.sync_host_s += time.perf_counter() - t0
        # Undelivered older pushes of p may be folded into this one (`recovery.Outbox`).
        ticket = self.outbox.add(
            p, self.versions[p], self.steps_since[p], self.tokens_since[p], not self.compressed
        )
        # The round moves on before the job starts: `_sync` checks it to know whether a newer
        # push of p has taken over the wait for a merge.
        self.rounds[p] += 1
        job = self.pool.submit(
            self._sync,
            p,
            self.rounds[p] - 1,
            self.versions[p],
            self.anchor[p],
            local,
            ticket.steps,
            ticket.tokens,
            final,
            self.step,
            ticket,
        )
        self.jobs = [j for j in self.jobs if not j.done()] + [job]
        self.steps_since[p] = self.tokens_since[p] = 0

    def _compress(self, p: int, leaves: list[jax.Array]) -> Encoded:
        """Encodes fragment p's outer gradient on the mesh (error feedback: updates the residual).

        Waits for the (small) result, so that the next step may donate the parameters and
        no second multi-device program is queued behind it.
        """
        residual = None
        if self.ef_residual is not None:
            residual_leaves = self.treedef.flatten_up_to(self.ef_residual)
            residual = F.gather(residual_leaves, self.cut[p])
            if self.unsent_in_params[p]:  # keep_unsent: θ holds it, so Δ = anchor − θ does
                residual = [jnp.zeros_like(x) for x in residual]
                self.unsent_in_params[p] = False
        sections, new_residual = self._encode(self.anchor[p], leaves, residual)
        sections = jax.device_get(sections)
        if new_residual is not None:
            for spec, value in zip(self.cut[p], new_residual, strict=True):
                residual_leaves[spec.index] = jax.device_put(value, self.shardings[spec.index])
            self.ef_residual = jax.tree.unflatten(self.treedef, residual_leaves)
        return Encoded(wire.encoded_arrays(sections, self.cut[p], self.codec))

    def checkpoint_items(self) -> dict[str, Any]:
        """This learner's state pytrees for its Orbax checkpoint, by name.

        Compression registers `ef_residual` here when error feedback is on (its sharding is
        the parameters'); restore by assigning the restored tree back to `self.ef_residual`.
        """
        items: dict[str, Any] = {}
        if self.ef_residual is not None:
            items["ef_residual"] = self.ef_residual
        return items

    def run(self) -> dict[str, Any]:
        """Trains `train_steps` inner steps, then pushes what is left; returns a summary."""
        c = self.config
        dataset = tasks.load_dataset(c)  # the text corpus or the image set of the config
        batches = dataset.train_iterator(c.data.batch_size, self.id, c.num_learners, c.seed)
        self.startup["data_loaded"] = time.time()
        if self.checkpoints is not None:  # a restart resumes its checkpoint and data position
            self._mark("restoring")
            state = self.checkpoints.restore(self, lambda: self.island.init(c.seed), batches)
            self.next_due = recovery.reschedule(self.step, len(self.cut), c.inner_steps)
        else:
            state = self.island.init(c.seed)
        self.startup["restored"] = time.time()
        leaves = self.treedef.flatten_up_to(state.params)
        # Start (or rejoin) from the syncer's global values, pulled by `connect`.
        for p, frag in enumerate(self.cut):
            for spec, value in zip(frag, self.anchor[p], strict=True):
                leaves[spec.index] = self._place(value, self.shardings[spec.index])
        state = InnerState(jax.tree.unflatten(self.treedef, leaves), state.opt_state)
        if self.compressed:  # Compile every fragment's encoder now, not in the step loop.
            ef = self.ef_residual
            residual = None if ef is None else self.treedef.flatten_up_to(ef)
            for p, frag in enumerate(self.cut):
                jax.block_until_ready(
                    self._encode(
                        self.anchor[p],
                        F.gather(self.treedef.flatten_up_to(state.params), frag),
                        None if residual is None else F.gather(residual, frag),
                    )
                )
        beat = threading.Thread(target=self._heartbeats, daemon=True)
        beat.start()
        t_start = t_window = time.perf_counter()
        for step in range(self.step + 1, c.train_steps + 1):
            state = self._apply_arrivals(state)
            first = not self._compiled  # this process's first step compiles
            self._mark("compiling" if first else "stepping", step)
            t_step = time.perf_counter()
            batch = next(batches)
            self.data_position += 1
            if self.checkpoints is not None:
                self.checkpoints.drew(self.data_position)  # before the step: see the data rule
            state, self.loss = self.island.step(state, self._batch(batch))
            slowdown = max(self.slowdown, self.chaos.slowdown() if self.chaos else 1.0)
            if slowdown > 1 or first:
                self.loss.block_until_ready()
                time.sleep((slowdown - 1) * (time.perf_counter() - t_step))
            if first:
                self.startup["first_step"] = time.time()
                print(f"[learner {self.id}] {recovery.startup_line(self.startup)}", flush=True)
            self._compiled = True
            self.step, self.tokens = step, self.tokens + c.tokens_per_step
            for p in range(len(self.cut)):
                self.steps_since[p] += 1
                self.tokens_since[p] += c.tokens_per_step
            for p in self.due(step):
                self._launch(state, p)
            if self.checkpoints is not None and self.checkpoints.due(step, c.train_steps):
                # Dispatched steps finish first: their compute is stepping time, not saving.
                self.loss.block_until_ready()
                self._mark("checkpointing", step)
                self.checkpoints.save(self, state, batches)
            if step % _STEP_WINDOW == 0:
                # Wall time per step over a window (single steps are dispatched asynchronously
                # and time nothing); the syncer's grace window and DyLU use it.
                now = time.perf_counter()
                self.step_time_s = (now - t_window) / _STEP_WINDOW
                t_window = now
            if step % c.log_every == 0 or step == c.train_steps:
                print(
                    f"[learner {self.id}] step {step}/{c.train_steps} loss {float(self.loss):.3f} "
                    f"versions {self.versions} {self.step_time_s * 1e3:.0f} ms/step",
                    flush=True,
                )
        train_wall = time.perf_counter() - t_start
        self.loss.block_until_ready()  # (the last steps' compute is stepping time)
        self._mark("blocked")  # the final flush
        for p in range(len(self.cut)):  # Final flush: the steps since each fragment's last push.
            if self.steps_since[p]:
                self._launch(state, p, final=True)
        t0 = time.perf_counter()
        futures.wait(self.jobs, timeout=2 * c.decoupled.syncer.rpc_timeout_s)
        flush_s = time.perf_counter() - t0
        self.stop.set()
        beat.join()
        self._heartbeat("done")
        self._mark("done")
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        return {
            "learner_id": self.id,
            "mesh": self.mesh_name,
            "steps": self.step,
            "tokens": self.tokens,
            "train_wall_s": train_wall,
            "blocked_s": self.blocked_s,
            "sync_host_s": self.sync_host_s,
            "final_flush_s": flush_s,
            # Blocked on the syncer (the loop never waits for it; this measures that claim).
            "stall_fraction": self.blocked_s / max(train_wall, 1e-9),
            # Host copies of fragments and device puts of merged ones, done in the loop.
            "sync_host_fraction": self.sync_host_s / max(train_wall, 1e-9),
            "final_loss": float(self.loss),
            "versions": self.versions,
            "pushes": self.pushes,
            # Recovery (see `learner_recovery`): restarts, the data rule, outage buffering.
            "restarts": self.restarts,
            "restored_from_step": self.restored_from_step,
            "data_position": self.data_position,
            "skipped_batches": self.skipped_batches,
            "lost_steps": self.lost_steps,
            "pushes_folded": self.outbox.folded,
            "pushes_dropped": self.outbox.dropped,
            "pushes_unsent": self.outbox.unsent(),
            "checkpoint_save_s": self.checkpoints.save_s if self.checkpoints else 0.0,
            "startup": self.startup,
            "retries": self.client.retries_done,
            "errors": self.errors,
            # Traffic of the data calls, headers included (the initial pulls too).
            "bytes_sent": self.client.bytes_sent,
            "bytes_received": self.client.bytes_received,
            "compression": self.codec.scheme,
            # Encoding on the mesh, done in the step loop (inside `sync_host_s`).
            "compress_s": self.compress_s,
            "compress_fraction": self.compress_s / max(train_wall, 1e-9),
            "rounds": self.round_log,
            "applied": self.applied,
        }
