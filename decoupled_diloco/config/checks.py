"""The checks behind `config.validate`: every field that could only fail later, by name.

Each check raises `ConfigError("config.FIELD: why")` for the first field that cannot work, so
a bad `--config.X=...` fails before anything is compiled or any process starts.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

from decoupled_diloco.config.derived import metric_writers, parse_mesh_shapes
from decoupled_diloco.config.processes import (
    COMPRESSION_SCHEMES,
    TOPK_VALUE_SCHEMES,
    CompressionConfig,
)
from decoupled_diloco.config.schema import (
    ATTENTION,
    DATASETS,
    DTYPES,
    INNER_OPTIMIZERS,
    MERGES,
    METRIC_WRITERS,
    MODEL_KINDS,
    MODES,
    WANDB_MODES,
    ConfigError,
    ExperimentConfig,
    ModelConfig,
)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.{field}: {message}")


def eval_sets(sets: str) -> dict[str, str]:
    """`eval.sets` as {name: path}, in the order given.

    Raises:
      ConfigError: an entry that is not NAME=PATH, a name that is not an identifier, or one
        given twice.
    """
    named: dict[str, str] = {}
    for entry in (e.strip() for e in sets.split(",") if e.strip()):
        name, _, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        _check(
            bool(path) and name.isidentifier(), "eval.sets",
            f"{entry!r}: expected NAME=PATH with NAME a word (letters, digits, _)",
        )  # fmt: skip
        _check(name not in named, "eval.sets", f"{name!r} is given twice")
        named[name] = path
    return named


def _validate_decoupled(c: ExperimentConfig) -> None:
    d, s = c.decoupled, c.decoupled.syncer
    _check(d.fragments >= 1, "decoupled.fragments", f"must be >= 1, got {d.fragments}")
    _check(
        d.fragments <= c.inner_steps,
        "decoupled.fragments",
        f"{d.fragments} fragments cannot be staggered over H={c.inner_steps} steps (need P <= H)",
    )
    _check(
        d.overlap_steps == -1 or 0 <= d.overlap_steps < c.inner_steps,
        "decoupled.overlap_steps",
        f"tau must be -1 (H // 5) or in [0, H={c.inner_steps}), got {d.overlap_steps}",
    )
    _check(
        1 <= d.quorum <= c.num_learners,
        "decoupled.quorum",
        f"K must be in [1, num_learners={c.num_learners}], got {d.quorum}",
    )
    _check(0 <= d.alpha < 1, "decoupled.alpha", f"must be in [0, 1), got {d.alpha}")
    _check(
        d.max_learners == 0 or d.max_learners >= c.num_learners,
        "decoupled.max_learners",
        f"must be 0 (2 x num_learners) or >= num_learners={c.num_learners}, got {d.max_learners}",
    )
    _check(
        0 <= d.data_shards <= 65536,
        "decoupled.data_shards",
        f"must be in [0, 65536] (0: static shards), got {d.data_shards}",
    )
    _check(d.max_lease_grants >= 0, "decoupled.max_lease_grants", "must be >= 0 (0: no bound)")
    _check(
        d.global_batch in ("per_learner", "constant"),
        "decoupled.global_batch",
        f"expected 'per_learner' or 'constant', got {d.global_batch!r}",
    )
    _check(
        d.lease_unit >= 0 and (d.lease_unit == 0 or c.data.batch_size % d.lease_unit == 0),
        "decoupled.lease_unit",
        f"must be 0 or divide data.batch_size={c.data.batch_size}, got {d.lease_unit}",
    )
    _check(
        d.global_batch == "per_learner" or (d.data_shards > 0 and d.syncer.shards == 1),
        "decoupled.global_batch",
        "'constant' needs data leases (data_shards > 0, one syncer shard): static shards "
        "train one batch per step",
    )
    _check(
        d.global_batch == "per_learner" or d.island_processes == 1,
        "decoupled.global_batch",
        "'constant' needs single-process islands (island_processes=1): the processes of one "
        "island would each hear the live count at another time",
    )
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
    _check(d.island_heartbeat_s >= 1, "decoupled.island_heartbeat_s", "must be >= 1 (seconds)")
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
    _check(
        s.max_transfers >= 0,
        "decoupled.syncer.max_transfers",
        f"must be >= 0 (0: no bound), got {s.max_transfers}",
    )
    _check(s.max_delta_norm > 0, "decoupled.syncer.max_delta_norm", "must be > 0")
    _check(
        0 < s.max_weight_share <= 1,
        "decoupled.syncer.max_weight_share",
        f"must be in (0, 1], got {s.max_weight_share}",
    )
    _check(s.max_inflight_bytes >= 0, "decoupled.syncer.max_inflight_bytes", "must be >= 0")
    _check(
        s.max_streams_per_learner >= 0, "decoupled.syncer.max_streams_per_learner", "must be >= 0"
    )
    _check(s.stream_idle_s > 0, "decoupled.syncer.stream_idle_s", "must be > 0")
    _check(s.min_pull_bytes_per_s > 0, "decoupled.syncer.min_pull_bytes_per_s", "must be > 0")


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


def _validate_wan(c: ExperimentConfig) -> None:
    rate = c.decoupled.wan_mbit
    _check(
        rate == 0 or (math.isfinite(rate) and rate >= 0.008),
        "decoupled.wan_mbit",
        f"must be 0 (no limit) or a finite rate of at least 0.008 Mbit/s, got {rate}",
    )
    sites = c.decoupled.wan_sites
    _check(
        sites in ("learner", "process"),
        "decoupled.wan_sites",
        f'must be "learner" or "process", got {sites!r}',
    )
    if rate > 0:
        _check(
            sites == "learner" or c.decoupled.island_processes > 1,
            "decoupled.wan_sites",
            '"process" puts the processes of a multi-process island in sites of their own; '
            "set decoupled.island_processes > 1 (or wan_sites='learner')",
        )
        s = c.decoupled.syncer
        chunk_s = s.chunk_bytes * 8 / (rate * 1e6)
        _check(
            chunk_s <= min(s.stream_idle_s, s.rpc_timeout_s) / 2,
            "decoupled.syncer.chunk_bytes",
            f"one chunk of {s.chunk_bytes} bytes takes {chunk_s:.1f} s at wan_mbit={rate:g}, "
            f"more than half of min(stream_idle_s, rpc_timeout_s) = "
            f"{min(s.stream_idle_s, s.rpc_timeout_s):g} s, after which a stream that moves "
            f"nothing is cut; use at most "
            f"{int(min(s.stream_idle_s, s.rpc_timeout_s) / 2 * rate * 1e6 / 8)} bytes",
        )
        _check(
            rate * 1e6 / 8 >= s.min_pull_bytes_per_s,
            "decoupled.syncer.min_pull_bytes_per_s",
            f"a pull must average {s.min_pull_bytes_per_s:g} bytes/s, more than the whole link "
            f"carries at wan_mbit={rate:g} ({rate * 1e6 / 8:g} bytes/s); every pull would be cut",
        )
        spread = c.num_learners * (c.decoupled.island_processes if sites == "process" else 1)
        _check(
            spread <= 63,
            "decoupled.wan_mbit",
            f"at most 63 sites fit the emulated WAN's addresses, got {spread}",
        )
        _check(
            not c.decoupled.syncer.tls_cert,
            "decoupled.wan_mbit",
            "learners reach the syncer at the emulated links' addresses, which a local TLS "
            "certificate does not name; set decoupled.syncer.tls_cert=''",
        )
        _check(c.mode == "decoupled", "decoupled.wan_mbit", "limits a decoupled run's links")
        _check(
            not c.supervisor.standby,
            "decoupled.wan_mbit",
            "warm standby spares are not started in the learners' network namespaces; "
            "set supervisor.standby=0",
        )
        _check(
            not c.monitor.enabled,
            "decoupled.wan_mbit",
            "the monitor cannot reach learners inside their network namespaces yet; "
            "set monitor.enabled=False",
        )


def _validate_metrics(c: ExperimentConfig) -> None:
    names = metric_writers(c)
    for name in names:
        _check(
            name in METRIC_WRITERS,
            "metrics.writers",
            f"unknown writer {name!r}; choose from {', '.join(METRIC_WRITERS)}",
        )
    _check(
        len(set(names)) == len(names),
        "metrics.writers",
        f"a writer is named twice in {c.metrics.writers!r}",
    )
    _check(
        c.metrics.wandb_mode in WANDB_MODES,
        "metrics.wandb_mode",
        f"must be one of {WANDB_MODES}, got {c.metrics.wandb_mode!r}",
    )
    _check(
        "wandb" not in names or importlib.util.find_spec("wandb") is not None,
        "metrics.writers",
        "wandb is not installed: pip install 'decoupled_diloco[wandb]'",
    )


def _validate_monitor(c: ExperimentConfig) -> None:
    m = c.monitor
    _check(0 <= m.port <= 65535, "monitor.port", f"must be in [0, 65535], got {m.port}")
    _check(m.refresh_s > 0, "monitor.refresh_s", "must be > 0")
    _check(
        not m.enabled or c.mode == "decoupled",
        "monitor.enabled",
        f"serves a decoupled run (a syncer and learner processes); mode {c.mode!r} writes "
        "metrics.jsonl and TensorBoard events (see docs/operations.md)",
    )


def _validate_supervisor(c: ExperimentConfig) -> None:
    sup = c.supervisor
    _check(sup.max_restarts >= 0, "supervisor.max_restarts", "must be >= 0")
    _check(sup.restart_backoff_s >= 0, "supervisor.restart_backoff_s", "must be >= 0")
    _check(sup.crash_loop >= 1, "supervisor.crash_loop", "must be >= 1")
    _check(sup.min_uptime_s >= 0, "supervisor.min_uptime_s", "must be >= 0")
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


def _validate_model(m: ModelConfig) -> None:
    _check(
        m.vocab_size >= 0,
        "model.vocab_size",
        f"must be >= 0 (0: from the data), got {m.vocab_size}",
    )
    for name in ("d_model", "num_layers", "num_heads", "mlp_hidden", "seq_len"):
        value = getattr(m, name)
        _check(value >= 1, f"model.{name}", f"must be >= 1, got {value}")
    _check(
        m.d_model % m.num_heads == 0 and (m.d_model // m.num_heads) % 2 == 0,
        "model.num_heads",
        f"d_model {m.d_model} must split into {m.num_heads} heads of even size (rotary)",
    )
    _check(m.dtype in DTYPES, "model.dtype", f"unknown dtype {m.dtype!r}; expected one of {DTYPES}")
    _check(
        m.attention in ATTENTION,
        "model.attention",
        f"unknown implementation {m.attention!r}; expected one of {ATTENTION}",
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


def check(config: ExperimentConfig, device_count: int | None = None) -> None:
    """`config.validate`'s checks (see there)."""
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
    builtin = not c.task  # a user's task (`config.task`) owns its model and data
    if builtin:
        _validate_model(m)
    else:
        module, _, function = c.task.partition(":")
        _check(
            bool(module) and function.isidentifier(),
            "task",
            f"{c.task!r} is not 'module:function' (e.g. 'mypkg.tasks:make_task')",
        )
    _check(c.data.batch_size >= 1, "data.batch_size", f"must be >= 1, got {c.data.batch_size}")
    _check(
        0.0 < c.data.val_fraction < 1.0,
        "data.val_fraction",
        f"must be in (0, 1), got {c.data.val_fraction}",
    )
    _check(
        c.optim.name in INNER_OPTIMIZERS,
        "optim.name",
        f"unknown inner optimizer {c.optim.name!r}; expected one of {INNER_OPTIMIZERS}",
    )
    _check(c.optim.lr > 0, "optim.lr", f"must be > 0, got {c.optim.lr}")
    _check(c.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    k = c.optim.microbatches
    _check(k >= 1, "optim.microbatches", f"must be >= 1 (1: no accumulation), got {k}")
    _check(
        c.data.batch_size % k == 0,
        "optim.microbatches",
        f"{k} microbatches do not divide data.batch_size={c.data.batch_size}",
    )
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
        _check(
            (c.data.batch_size // c.optim.microbatches) % data_axis == 0,
            "optim.microbatches",
            f"a microbatch of {c.data.batch_size // c.optim.microbatches} rows "
            f"(data.batch_size / optim.microbatches) does not split over the mesh data axis "
            f"of size {data_axis}",
        )
        for name in ("d_model", "mlp_hidden", "vocab_size", "num_heads") if builtin else ():
            value = getattr(m, name)
            _check(
                value % model_axis == 0 or (name == "vocab_size" and not value),
                field,
                f"model axis {model_axis} does not divide model.{name}={value}",
            )
    if c.mode == "decoupled":  # the synchronous modes ignore these fields
        _validate_decoupled(c)
    _validate_compression(c.compression)
    if builtin:
        _validate_model_kind(c)
    _validate_supervisor(c)
    _validate_monitor(c)
    _validate_metrics(c)
    _validate_wan(c)
    _check(c.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 disables)")
    _check(c.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", "must be >= 1")
    _check(c.eval.every >= 0, "eval.every", "must be >= 0 (0: evaluate only at the end)")
    _check(c.eval.batches >= 1, "eval.batches", "must be >= 1")
    eval_sets(c.eval.sets)
    if device_count is not None and c.mode != "decoupled":  # decoupled: one process each
        needed = c.num_learners * c.devices_per_learner
        _check(
            needed <= device_count,
            "num_learners",
            f"{c.num_learners} learners x mesh.shape {c.mesh.shape} need {needed} devices, "
            f"but only {device_count} are available (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})",
        )
