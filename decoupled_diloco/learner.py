r"""A learner process: inner steps on its own mesh, fragments synced in the background.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=127.0.0.1:50051 \
      --learner_id=0 --config=experiments/configs/tiny_lm.py --config.mode=decoupled

The step loop never waits for the syncer. When fragment p is due (staggered schedule, see
`fragments`), the loop copies its tensors to the host and hands them to a background worker,
which computes the outer gradient Δ = anchor_p − θ_p, pushes it, and then waits for the merged
fragment. A merged fragment that has arrived is applied at the next step boundary at least τ
(`overlap_steps`) steps after its push: overwritten (`alpha` = 0) or mixed as
α·local + (1 − α)·global. It becomes the new anchor. What arrives is host numpy; the learner
puts it onto its own mesh, so learners with different mesh shapes share one syncer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import threading
import time
from concurrent import futures
from typing import Any

import jax
import numpy as np

from decoupled_diloco import data as data_lib
from decoupled_diloco import fragments as F
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.config import ExperimentConfig, parse_mesh_shapes
from decoupled_diloco.island import InnerState, Island

_STEP_WINDOW = 10  # steps per measurement of this learner's step time


@dataclasses.dataclass
class Inbound:
    """A merged fragment waiting for its step boundary."""

    version: int
    values: list[np.ndarray]
    apply_after_step: int


class Learner:
    """One learner: an island, its data shard, per-fragment counters and a background syncer link.

    Args:
      config: the experiment.
      learner_id: this learner's index (its data shard and identity at the syncer).
      address: HOST:PORT of the syncer.
      devices: this learner's devices (default: the first ones the mesh needs).
      mesh_shape: (`data`, `model`) axes; default from `decoupled.mesh_shapes` or `mesh.shape`.
      slowdown: >1 makes every step this many times slower (older hardware stand-in).
      token: the run token (default: config or `DD_RUN_TOKEN`).
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
    ):
        self.config, self.id, self.slowdown = config, learner_id, slowdown
        shape = mesh_shape or parse_mesh_shapes(config)[learner_id]
        devices = devices or jax.devices()[: shape[0] * shape[1]]
        self.mesh_name = f"{shape[0]}x{shape[1]}"
        self.island = Island(config, devices, mesh_shape=shape)
        self.specs = F.tensor_specs(self.island.abstract_params)
        self.cut = F.partition(self.specs, config.decoupled.fragments)
        self.treedef = jax.tree.structure(self.island.abstract_params)
        self.shardings = self.treedef.flatten_up_to(self.island.param_sharding)
        self.client = SyncerClient(address, config.decoupled.syncer, token)
        num = len(self.cut)
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
        self.inbox_lock = threading.Lock()
        self.pool = futures.ThreadPoolExecutor(max_workers=num + 1)
        self.jobs: list[futures.Future] = []
        self.stop = threading.Event()
        self.step = self.tokens = 0
        self.loss: Any = float("nan")
        self.eval_loss = float("nan")  # Learners do not evaluate; the launcher evaluates Θ.
        self.step_time_s = 0.0
        self.blocked_s = self.sync_host_s = 0.0
        self.errors: list[str] = []
        self.pushes = {"accepted": 0, "late": 0, "duplicate": 0}

    # Syncer link -----------------------------------------------------------------------------

    def connect(self, timeout_s: float = 120.0, peers_s: float = 60.0) -> None:
        """Waits for the syncer, registers, and takes the current global fragments.

        In a fresh run (every fragment still at version 0) it also waits up to `peers_s` for
        all learners to register, so that they start together and their pushes of a round
        arrive close enough for the grace window to merge them. A learner joining a run in
        progress never waits.
        """
        self.client.wait_ready(timeout_s)
        reply = self.client.register(self.id, F.fingerprint(self.specs), self.mesh_name)
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

    def _sync(
        self,
        p: int,
        rnd: int,
        base: int,
        anchor: list,
        local: list,
        steps: int,
        tokens: int,
        final: bool,
        pushed_at: int,
    ) -> None:
        """Background: push Δ = anchor − θ for fragment p, then wait for the merged fragment.

        The merged fragment is due at the step boundary after step `pushed_at` + τ, or at the
        first boundary after it arrives if it comes later.
        """
        try:
            delta = [a - x for a, x in zip(anchor, local, strict=True)]
            reply = self.client.push(
                learner_id=self.id,
                fragment=p,
                round=rnd,
                base_version=base,
                steps=steps,
                tokens=tokens,
                specs=self.cut[p],
                arrays=delta,
            )
            self.pushes[
                "duplicate" if reply.duplicate else "accepted" if reply.accepted else "late"
            ] += 1
            if final:
                return
            # Short waits, so that a learner shutting down is never held by a pending pull.
            wait_s = min(self.config.decoupled.syncer.rpc_timeout_s, 5.0)
            version = -1
            while version < 0 and not self.stop.is_set():
                version, values = self.client.pull(self.id, p, base + 1, wait_s)
            if version >= 0:
                with self.inbox_lock:
                    held = self.inbox.get(p)
                    if held is None or held.version < version:
                        after = pushed_at + self.config.decoupled.overlap_steps
                        self.inbox[p] = Inbound(version, values, after)
        except Exception as error:  # noqa: BLE001 - the step loop must go on; report it.
            self.errors.append(f"fragment {p} round {rnd}: {type(error).__name__}: {error}")
            print(f"[learner {self.id}] sync error: {self.errors[-1]}", file=sys.stderr, flush=True)

    def _heartbeats(self) -> None:
        while not self.stop.wait(self.config.decoupled.syncer.heartbeat_s):
            self._heartbeat("training")

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

    def _heartbeat(self, state: str) -> None:
        try:
            reply = self.client.heartbeat(
                learner_id=self.id,
                step=self.step,
                tokens=self.tokens,
                loss=float(self.loss),
                state=state,
                versions=self.versions,
                blocked_s=self.blocked_s,
                step_time_s=self.step_time_s,
                eval_loss=self.eval_loss,
            )
            self.fastest_step_s = reply.fastest_step_time_s
        except Exception as error:  # noqa: BLE001 - a missed heartbeat is not fatal.
            print(f"[learner {self.id}] heartbeat failed: {error}", file=sys.stderr, flush=True)

    # Step loop -------------------------------------------------------------------------------

    def _apply_arrivals(self, state: InnerState) -> InnerState:
        """Merges every fragment whose overlap has passed into the live parameters."""
        t0 = time.perf_counter()
        with self.inbox_lock:
            ready = {p: x for p, x in self.inbox.items() if self.step >= x.apply_after_step}
            for p in ready:
                del self.inbox[p]
        self.blocked_s += time.perf_counter() - t0
        if not ready:
            return state
        t0 = time.perf_counter()
        leaves = self.treedef.flatten_up_to(state.params)
        alpha = self.config.decoupled.alpha
        for p, inbound in ready.items():
            for spec, value in zip(self.cut[p], inbound.values, strict=True):
                placed = jax.device_put(value, self.shardings[spec.index])
                leaves[spec.index] = (
                    placed if alpha == 0 else alpha * leaves[spec.index] + (1 - alpha) * placed
                )
            self.anchor[p], self.versions[p] = inbound.values, inbound.version
        self.sync_host_s += time.perf_counter() - t0
        return InnerState(jax.tree.unflatten(self.treedef, leaves), state.opt_state)

    def _launch(self, state: InnerState, p: int, final: bool = False) -> None:
        leaves = F.gather(self.treedef.flatten_up_to(state.params), self.cut[p])
        # Steps run ahead asynchronously: wait for them outside the timer, so that it measures
        # the copy itself and not the compute it would otherwise absorb.
        jax.block_until_ready(leaves)
        t0 = time.perf_counter()
        # A host copy now: the next step donates (invalidates) these device buffers.
        local = [np.asarray(x) for x in jax.device_get(leaves)]
        self.sync_host_s += time.perf_counter() - t0
        job = self.pool.submit(
            self._sync,
            p,
            self.rounds[p],
            self.versions[p],
            self.anchor[p],
            local,
            self.steps_since[p],
            self.tokens_since[p],
            final,
            self.step,
        )
        self.jobs = [j for j in self.jobs if not j.done()] + [job]
        self.rounds[p] += 1
        self.steps_since[p] = self.tokens_since[p] = 0

    def run(self) -> dict[str, Any]:
        """Trains `train_steps` inner steps, then pushes what is left; returns a summary."""
        c = self.config
        corpus = data_lib.load_corpus(c.data.path, c.data.val_fraction)
        batches = data_lib.train_iterator(
            corpus.train_BN, c.model.seq_len, c.data.batch_size, self.id, c.num_learners, c.seed
        )
        state = self.island.init(c.seed)
        leaves = self.treedef.flatten_up_to(state.params)
        for p, frag in enumerate(self.cut):  # Start from the syncer's global values.
            for spec, value in zip(frag, self.anchor[p], strict=True):
                leaves[spec.index] = jax.device_put(value, self.shardings[spec.index])
        state = InnerState(jax.tree.unflatten(self.treedef, leaves), state.opt_state)
        beat = threading.Thread(target=self._heartbeats, daemon=True)
        beat.start()
        t_start = t_window = time.perf_counter()
        for step in range(1, c.train_steps + 1):
            state = self._apply_arrivals(state)
            t_step = time.perf_counter()
            state, self.loss = self.island.step(state, next(batches))
            if self.slowdown > 1:
                self.loss.block_until_ready()
                time.sleep((self.slowdown - 1) * (time.perf_counter() - t_step))
            self.step, self.tokens = step, self.tokens + c.tokens_per_step
            for p in range(len(self.cut)):
                self.steps_since[p] += 1
                self.tokens_since[p] += c.tokens_per_step
            for p in self.due(step):
                self._launch(state, p)
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
        for p in range(len(self.cut)):  # Final flush: the steps since each fragment's last push.
            if self.steps_since[p]:
                self._launch(state, p, final=True)
        t0 = time.perf_counter()
        futures.wait(self.jobs, timeout=2 * c.decoupled.syncer.rpc_timeout_s)
        flush_s = time.perf_counter() - t0
        self.stop.set()
        beat.join()
        self._heartbeat("done")
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
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
            "retries": self.client.retries_done,
            "errors": self.errors,
        }


def _mesh_shape(config: ExperimentConfig, learner_id: int, override: str) -> tuple[int, int]:
    """This learner's mesh: the `--mesh_shape` flag, else the config."""
    if override:
        parts = override.lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
            raise ValueError(f"--mesh_shape: {override!r} is not DATAxMODEL (e.g. 2x1)")
        return int(parts[0]), int(parts[1])
    return parse_mesh_shapes(config)[learner_id]


def main(argv: list[str]) -> None:
    """Parses flags, runs the learner, writes its summary."""
    from absl import flags

    from decoupled_diloco import config as config_lib

    values = flags.FLAGS
    config = config_lib.from_config_dict(values.config)
    shape = _mesh_shape(config, values.learner_id, values.mesh_shape)
    slowdown = values.slowdown or (
        config.slowdown if config.slow_learner == values.learner_id else 1.0
    )
    learner = Learner(config, values.learner_id, values.syncer, mesh_shape=shape, slowdown=slowdown)
    learner.connect()
    summary = learner.run()
    if values.summary:
        pathlib.Path(values.summary).write_text(json.dumps(summary, indent=2) + "\n")
    stall = 100 * summary["stall_fraction"]
    print(f"[learner {learner.id}] done: {summary['steps']} steps, stall {stall:.2f}%", flush=True)


if __name__ == "__main__":
    import os

    from absl import app, flags
    from ml_collections import config_flags

    from decoupled_diloco.procs import die_with_parent

    config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
    flags.DEFINE_string("syncer", "127.0.0.1:50051", "HOST:PORT of the syncer.")
    flags.DEFINE_integer("learner_id", 0, "This learner's index.")
    flags.DEFINE_string("mesh_shape", "", "DATAxMODEL, overriding the config (e.g. 2x1).")
    flags.DEFINE_float("slowdown", 0.0, "Step slow-down factor (default: from the config).")
    flags.DEFINE_string("summary", "", "Write this learner's summary JSON here.")
    die_with_parent()

    def _start(argv: list[str]) -> None:
        # On CPU, fake as many devices as the mesh needs (and raise XLA:CPU's collective
        # timeouts), before JAX picks a backend.
        from decoupled_diloco import config as config_lib
        from decoupled_diloco.cpu_devices import configure_cpu_devices

        config = config_lib.from_config_dict(flags.FLAGS.config)
        shape = _mesh_shape(config, flags.FLAGS.learner_id, flags.FLAGS.mesh_shape)
        configure_cpu_devices(shape[0] * shape[1])
        try:
            main(argv)
        except KeyboardInterrupt:
            # Ctrl+C: leave now; background syncs hold no state worth waiting for.
            os._exit(130)

    sys.exit(app.run(_start))
