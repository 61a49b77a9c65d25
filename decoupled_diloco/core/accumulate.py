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

The sums are numpy on the host, in float32 with norms in float64, a bounded chunk at a time:
one round costs one fragment-sized buffer. `FlatStep` then applies the outer optimizer (optax,
compiled once per fragment, on the host CPU) to the fragment as one flat vector in one fused
pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
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

    The sums may live in memory XLA owns on the host CPU (`storage`, from
    `runtime.xla_host_vector`), written here through a numpy view of it, so that the outer step
    can take that memory for the new values (`take`, `FlatStep`): a close then needs no
    fragment-sized allocation. (XLA does not write its outputs into memory it did not
    allocate; measured on one 114 MB fragment, a fresh output's page faults alone took
    ~0.014 s.)

    Args:
      sizes: the number of values of each tensor of the fragment, in order.
      plain: per tensor, True for a mean tensor (embeddings, batch statistics, or every tensor
        with merge "mean"), False for an RDA one.
      storage: (an XLA-owned zero vector of the fragment's size, a writable numpy view of
        it), or None: a numpy buffer of its own.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        plain: Sequence[bool],
        storage: tuple[jax.Array, np.ndarray] | None = None,
    ):
        self.sizes, self.plain = list(sizes), list(plain)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        n = int(self.offsets[-1])
        self.owned: jax.Array | None = None
        if storage is None:
            self.buffer = aligned_zeros(n)
        else:
            self.owned, self.buffer = storage
            if self.buffer.shape != (n,) or self.buffer.dtype != np.float32:
                raise ValueError(f"storage of {self.buffer.shape} {self.buffer.dtype}: want ({n},)")
        self.norm_sum = np.zeros(len(self.sizes), np.float64)  # N_t of the RDA tensors

    def take(self) -> jax.Array | np.ndarray:
        """The finished sums as one vector, for the outer step to consume; the round is gone.

        An XLA-owned vector is to be donated: its memory becomes the step's output, so the
        numpy view must not be used again (dropped here: a later use fails, never writes).
        """
        vector = self.buffer if self.owned is None else self.owned
        self.buffer = self.owned = None
        return vector

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


def host_device() -> jax.Device:
    """The host CPU's JAX device (the default device where the CPU backend is not loaded)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


class FlatStep:
    """An element-wise outer optimizer (`outer.make_outer_optimizer`) on one flat vector.

    The fragment's tensors are one float32 vector; `tx` sees it as the tree {"flat": vector}.
    One compiled call steps the whole vector: XLA fuses the update into one pass, so it needs
    no vector-sized temporaries beyond its outputs, and the squared norms of the step (the merged
    step's check, `syncer.admission.check_step`) and of the new values (the next admission
    bounds' scale) come out of the same call.

    Buffers (measured on one 114 MB fragment: 0.05-0.07 s against 0.12-0.17 s a chunk at a
    time with the outputs copied back): the new values are never written over values already
    installed, so snapshots and pulls may go on reading the old ones; they take the memory of
    the round's sums where XLA owns it (`RoundSum.take`), else a fresh vector. The state is
    donated, so XLA steps it in place, except where someone still reads it: a snapshot being
    written holds numpy views of the state's arrays (`syncer.durability.snapshot`), and XLA's
    CPU client does not donate a buffer with such references (it writes a new one and leaves
    the old as it was; `tests/test_accumulate.py` checks both).

    Args:
      tx: the outer optimizer.
      size: the vector's length.
      averaged: (start, stop) ranges of the vector whose new values are `params − grads`
        instead of the optimizer's (averaged state such as batch statistics, which moves by
        the mean itself).
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        size: int,
        averaged: Sequence[tuple[int, int]] = (),
    ):
        self.tx, self.size, self.averaged = tx, size, [tuple(r) for r in averaged]
        # Host work wherever the process's default device is (an in-process syncer beside
        # learners on a GPU would otherwise keep the outer momentum in the GPU's memory).
        self.device = host_device()

        def step(params, state, grads):
            updates, state = tx.update({"flat": grads}, state, {"flat": params})
            new = optax.apply_updates({"flat": params}, updates)["flat"]
            for start, stop in self.averaged:
                new = new.at[start:stop].set(params[start:stop] - grads[start:stop])
            d = new - params
            # (A donated buffer goes to the first output of its shape: the state comes first,
            # so that it is stepped in place, and the sums' memory takes the new values.)
            return state, new, jnp.sum(d * d), jnp.sum(new * new)

        self._jit = jax.jit(step, donate_argnums=(1, 2))
        self._compiled = None
        self._treedef = jax.tree.structure(tx.init({"flat": np.zeros(1, np.float32)}))

    def warm_up(self) -> None:
        """Compiles the step ahead of the first merge (from shapes: nothing is allocated)."""
        if self._compiled is None:
            where = jax.sharding.SingleDeviceSharding(self.device)
            vector = jax.ShapeDtypeStruct((self.size,), jnp.float32, sharding=where)
            state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                jax.eval_shape(self.tx.init, {"flat": vector}),
            )
            self._compiled = self._jit.lower(vector, state, vector).compile()

    def init(self) -> list[jax.Array]:
        """The optimizer's state for a vector of `size` values, as a list of leaves.

        `tx.init` of a one-value vector, each per-value leaf then filled out to `size`: one
        allocation per leaf and each leaf its own array (`tx.init` of the whole vector made
        two more vector-sized arrays first, +2 GB at the start of a 1B syncer; and optax may
        give two zero leaves one buffer, which could not be donated twice).
        """
        one = jax.tree.leaves(self.tx.init({"flat": np.zeros(1, np.float32)}))
        with jax.default_device(self.device):
            return [
                jnp.full((self.size,), x[0], x.dtype) if x.shape == (1,) else jnp.array(x)
                for x in one
            ]

    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of `init`'s leaves (without making them)."""
        state = jax.eval_shape(
            self.tx.init, {"flat": jax.ShapeDtypeStruct((self.size,), jnp.float32)}
        )
        return [tuple(x.shape) for x in jax.tree.leaves(state)]

    def treedef(self):  # noqa: ANN201 - a jax treedef
        """The structure of the optimizer's state (`init`'s leaves)."""
        return self._treedef

    def __call__(
        self, params: np.ndarray, state: Sequence[Any], grads: np.ndarray
    ) -> tuple[np.ndarray, list[jax.Array], float, float]:
        """One outer step: (the new values, the new state's leaves, ‖new − params‖², ‖new‖²).

        `params` is read, not changed (aligned vectors are read in place, `core.host`); the
        new values are a read-only vector; `state` and `grads` are donated (a jax array among
        them is not to be used again; numpy ones are left as they were). The squared norm is
        inf or NaN where a new value is not finite (`params` is).
        """
        self.warm_up()
        state, new, step_sq, new_sq = self._compiled(
            params, jax.tree.unflatten(self.treedef(), list(state)), grads
        )
        return np.asarray(new), jax.tree.leaves(state), float(step_sq), float(new_sq)
