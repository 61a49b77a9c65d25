"""The syncer's merge, folded one outer gradient at a time: memory that does not grow with M.

`outer.merge` stacks M outer gradients and merges them at once (the synchronous trainer holds
them on its devices anyway). The syncer receives them one by one over minutes, so it folds
each into its fragment's open round as it arrives and keeps nothing else per learner:

  mean tensors:  S_t = Σ_m c_m Δ_m,t
  RDA tensors:   S_t = Σ_m c_m Δ_m,t / ‖Δ_m,t‖   and   N_t = Σ_m c_m ‖Δ_m,t‖

With the coefficients c_m the learners' final shares (summing to 1), `finish` turns the sums
into exactly what `outer.merge` computes: S_t for a mean tensor, N_t · S_t / ‖S_t‖ for an RDA
one (the weighted mean of the norms along the weighted mean direction). The caller decides the
coefficients (the syncer folds token weights as they come and rescales once the round closes,
`syncer.state`); a fold with a negative coefficient takes a contribution out again.

Everything is numpy on the host, in float32 with norms in float64, a bounded chunk at a time:
one round costs one fragment-sized buffer. `FlatStep` then applies the outer optimizer (optax,
jit-compiled once per chunk size) to the fragment as one flat vector, a chunk at a time, so
the outer step needs no fragment-sized temporaries either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
import optax

from decoupled_diloco.core.host import aligned_zeros

# Elements per numpy operation: temporaries stay ~1 MB whatever the tensor size.
CHUNK = 1 << 18
# Below this norm an outer gradient has no direction (as `outer._TINY_NORM`).
TINY_NORM = 1e-30


def _chunks(n: int) -> Iterable[slice]:
    for start in range(0, n, CHUNK):
        yield slice(start, min(start + CHUNK, n))


def norm(x: np.ndarray) -> float:
    """‖x‖ of a float32 array, its squares summed in float64 chunk by chunk (inf on overflow)."""
    flat = x.reshape(-1)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for c in _chunks(flat.size):
            part = flat[c]
            total += float(np.dot(part, part))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def axpy(y: np.ndarray, a: float, x: np.ndarray) -> None:
    """Adds a·x to y in place (flat float32 arrays), a chunk at a time."""
    a32 = np.float32(a)
    for c in _chunks(y.size):
        y[c] += a32 * x[c]


class RoundSum:
    """The sums of one fragment's open round (see the module doc).

    Args:
      sizes: the number of values of each tensor of the fragment, in order.
      plain: per tensor, True for a mean tensor (embeddings, batch statistics, or every tensor
        with merge "mean"), False for an RDA one.
    """

    def __init__(self, sizes: Sequence[int], plain: Sequence[bool]):
        self.sizes, self.plain = list(sizes), list(plain)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.buffer = aligned_zeros(int(self.offsets[-1]))
        self.norm_sum = np.zeros(len(self.sizes), np.float64)  # N_t of the RDA tensors

    def view(self, t: int) -> np.ndarray:
        """The flat sum of tensor t (a view into the round's buffer)."""
        return self.buffer[self.offsets[t] : self.offsets[t + 1]]

    def fold(self, tensors: Iterable[np.ndarray], coef: float) -> list[float]:
        """Adds one outer gradient with coefficient `coef`; returns its per-tensor norms.

        Args:
          tensors: the outer gradient's tensors in order (any shape; float32).
          coef: its coefficient (negative: take a fold out again).
        """
        norms = []
        for t, x in enumerate(tensors):
            flat = np.asarray(x, np.float32).reshape(-1)
            n = norm(flat)
            norms.append(n)
            if self.plain[t]:
                axpy(self.view(t), coef, flat)
            elif n > TINY_NORM:
                axpy(self.view(t), coef / n, flat)
                self.norm_sum[t] += coef * n
        if len(norms) != len(self.sizes):
            raise ValueError(f"{len(norms)} tensors folded into a round of {len(self.sizes)}")
        return norms

    def scale(self, factor: float) -> None:
        """Multiplies every sum by `factor` (the round's coefficients rescaled at once)."""
        f32 = np.float32(factor)
        for c in _chunks(self.buffer.size):
            self.buffer[c] *= f32
        self.norm_sum *= factor

    def finish(self, scale: float = 1.0, prescale: float = 1.0) -> list[np.ndarray]:
        """The merged outer gradient, times `scale`, computed in place; the round is spent.

        `prescale` is a `scale(prescale)` still to be applied first (done in the same pass).

        Returns:
          One flat float32 view per tensor (into the round's buffer); NaN where an outer
          gradient's norm overflowed (the syncer then refuses the merge).
        """
        out = []
        for t in range(len(self.sizes)):
            s = self.view(t)
            if self.plain[t]:
                factor = scale * prescale
            elif not math.isfinite(self.norm_sum[t]):  # a norm overflowed: no merge to make
                factor = math.nan
            else:  # (the direction's scale cancels: N·S/‖S‖)
                direction = norm(s)
                n = self.norm_sum[t] * prescale
                factor = scale * n / direction if direction > TINY_NORM else 0.0
            f32 = np.float32(factor)
            for c in _chunks(s.size):
                s[c] *= f32
            out.append(s)
        return out


class FlatStep:
    """An element-wise outer optimizer (`outer.make_outer_optimizer`) on one flat vector.

    The fragment's tensors are one float32 vector; `tx` sees it as the tree {"flat": vector}, a
    chunk at a time (SGD, Nesterov and delayed Nesterov act on each value alone; their scalar
    state, a step count, is the same for every chunk).

    Args:
      tx: the outer optimizer.
      size: the vector's length.
    """

    def __init__(self, tx: optax.GradientTransformation, size: int):
        self.tx, self.size = tx, size
        self.chunk = min(1 << 20, 1 << max(size - 1, 1).bit_length())

        def step(params, state, grads):
            updates, state = tx.update({"flat": grads}, state, {"flat": params})
            return optax.apply_updates({"flat": params}, updates)["flat"], state

        self._step = jax.jit(step)

    def warm_up(self) -> None:
        """Compiles the step (one chunk of zeros: no fragment-sized temporaries)."""
        n, state = self.chunk, self.init_chunk()
        self._step(
            np.zeros(n, np.float32),
            jax.tree.unflatten(self.treedef(), state),
            np.zeros(n, np.float32),
        )

    def init_chunk(self) -> list[np.ndarray]:
        """The optimizer's state for one chunk (as `init`, at the chunk's size)."""
        return [
            np.array(x)
            for x in jax.tree.leaves(self.tx.init({"flat": np.zeros(self.chunk, np.float32)}))
        ]

    def init(self) -> list[np.ndarray]:
        """The optimizer's state for a vector of `size` values, as a list of numpy leaves.

        `tx.init` of a zero vector, made a chunk at a time (every chunk's is the same): no
        fragment-sized temporaries beside the state itself.
        """
        n, size = self.chunk, self.size
        chunk = self.init_chunk()
        state = [aligned_zeros(size, x.dtype) if x.shape == (n,) else x for x in chunk]
        for start in range(0, size, n):
            stop = min(start + n, size)
            for leaf, part in zip(state, chunk, strict=True):
                if part.shape == (n,):
                    leaf[start:stop] = part[: stop - start]
        return state

    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of `init`'s leaves (without making them)."""
        n = self.chunk
        return [(self.size,) if x.shape == (n,) else x.shape for x in self.init_chunk()]

    def treedef(self):  # noqa: ANN201 - a jax treedef
        """The structure of the optimizer's state (`init`'s leaves)."""
        return jax.tree.structure(self.tx.init({"flat": np.zeros(1, np.float32)}))

    def __call__(
        self, params: np.ndarray, state: list[np.ndarray], grads: np.ndarray, out: np.ndarray
    ) -> list[np.ndarray]:
        """Writes the stepped `params` into `out` (may be `grads`); returns the new state.

        The state's vector leaves are new arrays (the old ones may be in a snapshot being
        written); `params` is not changed.
        """
        treedef, n, size = self.treedef(), self.chunk, self.size
        new = [aligned_zeros(size, x.dtype) if x.shape == (size,) else x for x in state]
        for start in range(0, size, n):
            stop = min(start + n, size)
            part = slice(start, stop)

            def piece(x: np.ndarray, part: slice = part, stop: int = stop) -> np.ndarray:
                if stop - part.start == n:
                    return x[part]
                return np.pad(x[part], (0, n - (stop - part.start)))  # the tail, padded

            leaves = [piece(x) if x.shape == (size,) else x for x in state]
            stepped, sub = self._step(
                piece(params), jax.tree.unflatten(treedef, leaves), piece(grads)
            )
            out[part] = np.asarray(stepped)[: stop - start]
            for i, leaf in enumerate(jax.tree.leaves(sub)):
                if state[i].shape == (size,):
                    new[i][part] = np.asarray(leaf)[: stop - start]
                elif start == 0:
                    new[i] = np.array(leaf)
        return new
