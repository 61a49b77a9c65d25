"""Compressed downlink: the syncer sends each learner the difference from the copy it holds.

Merged fragments are parameters, not outer gradients: quantizing them directly would lose the
model. Instead the syncer remembers, per learner and fragment, the exact copy of each recent
version it sent that learner (what the learner reconstructed, bit for bit), and answers a pull
from a learner that holds version b with encode(Θ^(v) − copy_b). The learner adds the decoded
difference to its copy_b; the syncer records copy_v = copy_b + decode(...) computed the same
way (numpy, float32). Quantization error therefore never accumulates across rounds: each copy
is within one encoding's error of the true Θ^(v).

A learner without a known copy (first pull, a restart, an evicted version) gets the full
values, which become its copy. A version already sent to that learner is resent as that exact
copy, so a learner that receives the same version twice holds the same values either way.
Memory: at most `keep` copies per learner and fragment.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import jax
import numpy as np

from decoupled_diloco.core import compression
from decoupled_diloco.core.compression import Codec
from decoupled_diloco.core.fragments import TensorSpec


class Downlink:
    """Per-learner compressed replies to pulls (see the module doc).

    Args:
      codec: the encoding of the differences.
      keep: copies remembered per learner and fragment.
    """

    def __init__(self, codec: Codec, keep: int = 4):
        self.codec, self.keep = codec, keep
        self.copies: dict[tuple[int, int], dict[int, list[np.ndarray]]] = {}
        self.lock = threading.Lock()
        self._encode = jax.jit(lambda xs: [compression.encode(x, codec) for x in xs])

    def reply(
        self,
        learner: int,
        fragment: int,
        version: int,
        values: Sequence[np.ndarray],
        specs: Sequence[TensorSpec],
        have_version: int | None,
    ) -> tuple[int | None, list[np.ndarray] | list[dict[str, np.ndarray]]]:
        """What to send learner `learner` for `version` of a fragment.

        Returns:
          (None, full values) or (base version, encoded sections of the difference from it).
        """
        with self.lock:
            copies = self.copies.setdefault((learner, fragment), {})
            if have_version is not None:  # the learner moved past older copies
                for v in [v for v in copies if v < have_version]:
                    del copies[v]
            if version in copies:
                return None, copies[version]
            ref = copies.get(have_version) if have_version is not None else None
            if ref is None:
                self._remember(copies, version, list(values))
                return None, list(values)
            diffs = [
                (np.asarray(v, np.float32) - np.asarray(r, np.float32)).reshape(-1)
                for v, r in zip(values, ref, strict=True)
            ]
            sections = [
                {k: np.asarray(a) for k, a in s.items()}
                for s in jax.device_get(self._encode(diffs))
            ]
            copy = [
                apply_difference(r, s, spec, self.codec)
                for r, s, spec in zip(ref, sections, specs, strict=True)
            ]
            self._remember(copies, version, copy)
            return have_version, sections

    def _remember(self, copies: dict[int, list[np.ndarray]], version: int, values: list) -> None:
        copies[version] = values
        for v in sorted(copies)[: max(len(copies) - self.keep, 0)]:
            del copies[v]


def apply_difference(
    ref: np.ndarray, sections: dict[str, np.ndarray], spec: TensorSpec, codec: Codec
) -> np.ndarray:
    """`ref` + decode(sections) in float32, cast to the tensor dtype (as the learner does)."""
    dtype = np.dtype(spec.dtype)
    diff = compression.decode(sections, math.prod(spec.shape), codec).reshape(spec.shape)
    return (np.asarray(ref, np.float32) + diff.astype(dtype, copy=False)).astype(dtype)
