r"""The syncer process: a gRPC server around `SyncerState`, serving `service.SyncerService`.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.syncer --port=50051 \
      --config=experiments/configs/tiny_lm.py --config.mode=decoupled

What a call must carry and what is checked: `syncer.service`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import jax
import numpy as np
from absl import logging

from decoupled_diloco import runtime, tasks
from decoupled_diloco.comm import wire
from decoupled_diloco.config import ExperimentConfig, lease_unit, units_per_step
from decoupled_diloco.core import fragments
from decoupled_diloco.syncer.guard import control_slots, data_slots
from decoupled_diloco.syncer.handlers import add_service
from decoupled_diloco.syncer.payloads import PushStore
from decoupled_diloco.syncer.service import SyncerService
from decoupled_diloco.syncer.state import SyncerState


def initial_fragments(
    config: ExperimentConfig, task: tasks.Task | None = None, initial: Any = None
) -> tuple[list[list[fragments.TensorSpec]], list[list]]:
    """The fragment partition of the task's synced tree and every fragment's initial values (host).

    From the task alone (default: `make_task(config)`): its abstract tree gives the partition, its
    initializer (the learners' seed, no mesh) version 0, unless `initial` (a tree like the
    task's, e.g. pretrained parameters) is given. Learners start from the syncer's values,
    whatever their meshes.

    Raises:
      ValueError: `initial` does not match the task's tree (structure, shapes or dtypes).
    """
    if task is None and not config.task and initial is None:
        task = tasks.make_task(config)
        size = sum(s.nbytes for s in fragments.tensor_specs(task.abstract_params()))
        if size <= _CACHED_BYTES:  # tests start many syncers of one small model
            partition, values = _builtin_fragments(config)
            return partition, list(
                values
            )  # (the caller may empty its list; the cache keeps its own)
    return _fragments(config, task or tasks.make_task(config), initial)


# Initial values of built-in models up to this size are kept for the next syncer of the
# process (a larger model's would cost its size for the process's lifetime).
_CACHED_BYTES = 64 << 20


@functools.lru_cache(maxsize=4)
def _builtin_fragments(
    config: ExperimentConfig,
) -> tuple[list[list[fragments.TensorSpec]], list[list]]:
    return _fragments(config, tasks.make_task(config))


def _fragments(
    config: ExperimentConfig, task: tasks.Task, initial: Any = None
) -> tuple[list[list[fragments.TensorSpec]], list[list]]:
    specs = fragments.tensor_specs(task.abstract_params())
    partition = fragments.partition(specs, config.decoupled.fragments)
    if initial is not None and fragments.tensor_specs(initial) != specs:
        given = task.fingerprint(fragments.tensor_specs(initial))
        raise ValueError(
            f"SyncerServer(initial_params=...): the tree does not match task "
            f"{task.identity()!r}'s (fingerprint {given} "
            f"against {task.fingerprint(specs)})"
        )
    leaves = jax.tree.leaves(initial if initial is not None else task.init_params(config.seed))
    for i, x in enumerate(leaves):  # each device array goes once it is on the host
        leaves[i] = np.asarray(jax.device_get(x))
    return partition, [fragments.gather(leaves, frag) for frag in partition]


def _taken(values: list[list]) -> Iterator[list]:
    """Each fragment's initial values in turn, dropped from `values` as it is taken.

    A large model's host copy then goes fragment by fragment as the syncer copies it in.
    """
    while values:
        yield values.pop(0)


def pause_in_merge(spec: str) -> Callable[[], None]:
    """A `SyncerState.merge_hook` from `N:PATH`: the N-th merge writes PATH and stops for good.

    The merge has computed the new values but not installed them, and holds the state lock,
    so that a test can kill the syncer in the middle of a merge (`--debug_pause_in_merge`).
    """
    count, path = spec.split(":", 1)
    seen = [0]

    def hook() -> None:
        seen[0] += 1
        if seen[0] == int(count):
            pathlib.Path(path).write_text(str(os.getpid()))
            threading.Event().wait()

    return hook


class SyncerServer:
    """A running syncer: the state, the gRPC server, and a thread closing rounds on time.

    Args:
      config: the experiment.
      host: interface to bind (127.0.0.1 for loopback, 0.0.0.0 for other hosts).
      port: port to bind; 0 picks a free one (see `.port`).
      token: the run token (default: from config or `DD_RUN_TOKEN`).
      shard: this shard's index; it owns the fragments p with p % `syncer.shards` == shard.
      checkpoint_dir: where this shard commits its state (see `durability`); it
        resumes from the newest readable commit there. None: in memory only.
      merge_hook: passed to `SyncerState` (tests: `pause_in_merge`).
      task: what is trained (default: `make_task(config)`, the user's `config.task` or the
        built-in model): its synced tree, initial values, merge rules and fingerprint.
      initial_params: version 0 of the global model, a tree like the task's (e.g. pretrained
        parameters); default: the task's initializer at `config.seed`.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        host: str = "",
        port: int = -1,
        token: str = "",
        shard: int = 0,
        checkpoint_dir: str | None = None,
        merge_hook: Callable[[], None] | None = None,
        task: tasks.Task | None = None,
        initial_params: Any = None,
    ):
        s = config.decoupled.syncer
        if not 0 <= shard < s.shards:
            raise ValueError(f"--shard={shard} is not in [0, decoupled.syncer.shards={s.shards})")
        if s.tls_cert and not s.tls_key:  # learners need only the certificate; a syncer both
            raise ValueError(
                "config.decoupled.syncer.tls_key: a TLS syncer needs its private key "
                f"(tls_cert is {s.tls_cert!r})"
            )
        builtin = task is None and not config.task  # then the partition and values are cached
        task = task or tasks.make_task(config)
        if config.task and not task.import_path:  # learners name it by config.task
            task = dataclasses.replace(task, import_path=config.task)
        partition, values = initial_fragments(config, None if builtin else task, initial_params)
        owned = [p for p in range(len(partition)) if p % s.shards == shard]
        self.shard = shard
        self.state = SyncerState(
            config,
            partition,
            _taken(values),  # emptied fragment by fragment: each host copy goes once copied in
            owned=owned,
            is_mean_only=task.is_mean_only,
            is_averaged=task.is_averaged,
            merge_hook=merge_hook,
        )
        self.committer = self.restored_step = None
        # Pushes of open rounds, as received: in the checkpoint directory (synced) when there
        # is one, else in a temporary directory.
        self.state.store = PushStore(
            pathlib.Path(checkpoint_dir) / "pushes" if checkpoint_dir else None,
            durable=bool(checkpoint_dir),
        )
        if checkpoint_dir:
            from decoupled_diloco.syncer.durability import Committer

            self.committer = Committer(
                self.state, checkpoint_dir, config.checkpoint.max_to_keep, s.snapshot_s
            )
            self.restored_step = self.committer.restore()
        self.state.warm_up()
        del values  # (empty now) version 0 is in the state; what initialising it left goes back
        runtime.trim_memory()
        self.fingerprint = task.fingerprint(
            sorted((x for f in partition for x in f), key=lambda x: x.index)
        )
        self.service = SyncerService(
            self.state,
            token or wire.run_token(s),
            self.fingerprint,
            # (the most rows a step trains: a constant global batch with one learner live)
            task.tokens_per_step(units_per_step(config, 1) * lease_unit(config)),
            task.tokens_per_step(lease_unit(config))
            if config.decoupled.global_batch == "constant"
            else 0,
        )
        self.service.committer = self.committer
        threads = data_slots(config) + control_slots(config) + 4
        self.server = grpc.server(
            # Data calls hold at most `data_slots` threads (`syncer.guard`); the rest serve the
            # control calls, which therefore never wait behind a push or a pull.
            futures.ThreadPoolExecutor(max_workers=threads),
            options=wire.channel_options(s),
            maximum_concurrent_rpcs=4 * threads,
        )
        add_service(self.service, self.server)
        address = f"{host or s.host}:{port if port >= 0 else s.port}"
        credentials = wire.server_credentials(s)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError as error:  # gRPC says only "Failed to bind"; say what to do.
            raise RuntimeError(
                f"the syncer cannot listen on {address}: the port is in use (another syncer "
                "still running?) or the host is not an address of this machine; pick another "
                f"--port, or --port=0 for any free one ({error})"
            ) from None
        self._stop = threading.Event()
        self._closer = threading.Thread(target=self._close_rounds, daemon=True)

    def _close_rounds(self) -> None:
        merges = -1
        while not self._stop.is_set():
            deadline = self.state.next_deadline()
            wait = 0.05 if deadline is None else max(min(deadline - self.state.clock(), 0.05), 0)
            self._stop.wait(wait)
            if self.state.wal_failed:  # nothing more can be made durable: stop serving
                self.server.stop(0)
                return
            try:
                self.state.tick()
            except Exception:  # noqa: BLE001 - keep closing rounds; the error is logged
                logging.exception("[syncer] closing rounds failed")
            done = sum(f.merges for f in self.state.fragments)
            if done != merges:  # a merge's temporaries are freed: give them back (outside the lock)
                merges = done
                runtime.trim_memory()

    def start(self) -> SyncerServer:
        """Starts serving; returns self."""
        if self.committer is not None:
            self.committer.start()
        self.server.start()
        self._closer.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight calls get `grace_s` to finish)."""
        self._stop.set()
        self.server.stop(grace_s).wait()
        self.service.guard.close()
        self.service.control.close()
        if self._closer.is_alive():  # a merge in progress ends before its files go
            self._closer.join(timeout=30)
        if self.committer is not None:
            self.committer.stop()
        self.state.store.close()
