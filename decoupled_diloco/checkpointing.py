"""Orbax checkpoints of one island: the only module that imports orbax.

Each checkpoint step holds two items: `state`, a pytree of arrays restored onto the island's
shardings (parameters, inner optimizer state, anchor, outer state), and `meta`, a JSON dict
(step, data-iterator positions, anything small). Saves are asynchronous; a restore walks back
from the newest step and skips any that fail to read, reporting each one, so a corrupt or
half-written latest checkpoint costs only the steps since the one before it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

PyTree = Any


class IslandCheckpointer:
    """Asynchronous Orbax checkpoints of one island in `directory`.

    Args:
      directory: where step folders are written (created if missing).
      max_to_keep: newest checkpoints kept; older ones are deleted after a successful save.
      immutable_host_arrays: the state is numpy arrays that the caller never changes once
        saved (the syncer: every merge writes new arrays). Orbax then writes them as they are,
        uncompressed (float32 values hardly compress), instead of first copying every array
        (`NumpyHandler`'s deep copy) and holding its compressed chunks: a snapshot costs no
        memory beyond the state itself.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        max_to_keep: int = 3,
        immutable_host_arrays: bool = False,
    ):
        self.directory = pathlib.Path(directory).absolute()
        self._in_place = immutable_host_arrays
        handlers = None
        if immutable_host_arrays:
            scalar = ocp.type_handlers.ScalarHandler()
            registry = ocp.type_handlers.create_type_handler_registry(
                (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
                *((t, scalar) for t in (int, float, np.number)),
                (jax.Array, ocp.type_handlers.ArrayHandler()),  # (none saved; Orbax asks)
            )
            handlers = {
                "state": ocp.PyTreeCheckpointHandler(
                    type_handler_registry=registry, use_compression=False
                ),
                "meta": ocp.JsonCheckpointHandler(),
            }
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
            ),
            item_names=None if handlers else ("state", "meta"),
            item_handlers=handlers,
        )

    def all_steps(self) -> list[int]:
        """Steps with a finished checkpoint on disk, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Starts an asynchronous save; the arrays may be donated as soon as this returns.

        Raises:
          RuntimeError: Orbax declined the save (a checkpoint at this or a later step exists).
        """
        save = ocp.args.PyTreeSave if self._in_place else ocp.args.StandardSave
        saved = self._manager.save(
            step, args=ocp.args.Composite(state=save(state), meta=ocp.args.JsonSave(meta))
        )
        if not saved:
            raise RuntimeError(
                f"checkpoint {self.directory}/{step} was not written: a checkpoint at step "
                f"{self._manager.latest_step()} already exists there"
            )

    def discard_after(self, step: int) -> None:
        """Deletes every checkpoint newer than `step`.

        Called once a restore has settled on `step`: newer checkpoints were unreadable (or
        belong to a run that is being replaced), and Orbax would refuse to save over them.
        """
        for newer in [s for s in self.all_steps() if s > step]:
            logging.warning(
                "deleting checkpoint %s/%d, newer than the restored step %d",
                self.directory,
                newer,
                step,
            )
            self._manager.delete(newer)

    def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restores `step` onto the shapes, dtypes and shardings of `abstract_state`."""
        restore = ocp.args.PyTreeRestore if self._in_place else ocp.args.StandardRestore
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=restore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return restored.state, dict(restored.meta)

    def restore_latest(
        self,
        abstract_state: PyTree,
        allowed: Callable[[int], bool] = lambda step: True,
    ) -> tuple[int, PyTree, dict[str, Any]] | None:
        """Restores the newest readable step for which `allowed(step)` holds.

        Returns:
          (step, state, meta), or None when no checkpoint can be restored.
        """
        for step in reversed(self.all_steps()):
            if not allowed(step):
                continue
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is skipped.
                logging.error(
                    "checkpoint %s/%d is unreadable (%s: %s); trying the previous one",
                    self.directory,
                    step,
                    type(error).__name__,
                    str(error).splitlines()[0][:300],
                )
                continue
            return step, state, meta
        return None

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
