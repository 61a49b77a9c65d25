"""Experiment configuration: frozen dataclasses, validated before anything is compiled.

Config files under `experiments/configs/` return `as_config_dict(ExperimentConfig(...))` so that
absl's `--config.X=...` overrides work (ml_collections cannot assign into frozen dataclasses);
`from_config_dict` turns the overridden dict back into a frozen, validated `ExperimentConfig`.
The fields are in `schema` and `processes`, the checks in `checks`. No JAX is imported here, so
a syncer or a tool can load configs cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from decoupled_diloco.config.checks import check, eval_sets
from decoupled_diloco.config.derived import (
    budget_units,
    data_leases,
    lease_shards,
    lease_unit,
    max_learners,
    max_push_steps,
    mesh_shape_for,
    metric_writers,
    overlap_steps,
    parse_mesh_shapes,
    units_per_step,
)
from decoupled_diloco.config.processes import (
    COMPRESSION_SCHEMES,
    TOPK_VALUE_SCHEMES,
    CompressionConfig,
    DecoupledConfig,
    MonitorConfig,
    SupervisorConfig,
    SyncerConfig,
)
from decoupled_diloco.config.schema import (
    DATASETS,
    DTYPES,
    INNER_OPTIMIZERS,
    MERGES,
    METRIC_WRITERS,
    MODEL_KINDS,
    MODES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    OuterConfig,
)

__all__ = [
    "COMPRESSION_SCHEMES",
    "CheckpointConfig",
    "CompressionConfig",
    "ConfigError",
    "DATASETS",
    "DTYPES",
    "DataConfig",
    "INNER_OPTIMIZERS",
    "DecoupledConfig",
    "EvalConfig",
    "ExperimentConfig",
    "MERGES",
    "METRIC_WRITERS",
    "MODEL_KINDS",
    "MODES",
    "MeshConfig",
    "MetricsConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "OuterConfig",
    "MonitorConfig",
    "SupervisorConfig",
    "SyncerConfig",
    "TOPK_VALUE_SCHEMES",
    "as_config_dict",
    "data_leases",
    "from_config_dict",
    "budget_units",
    "lease_shards",
    "lease_unit",
    "units_per_step",
    "max_learners",
    "max_push_steps",
    "mesh_shape_for",
    "metric_writers",
    "overlap_steps",
    "parse_mesh_shapes",
    "replace",
    "validate",
    "write_config_file",
]


_CONFIG_TEMPLATE = '''"""The resolved config of this run, written by `config.write_config_file`."""

import json

from decoupled_diloco import config as c


def get_config():
    return c.as_config_dict(c.from_config_dict(json.loads(r"""{values}""")))
'''


def write_config_file(config: ExperimentConfig, path: str | pathlib.Path) -> pathlib.Path:
    """Writes `config` as a config file that `--config=` accepts in any process."""
    path = pathlib.Path(path)
    path.write_text(_CONFIG_TEMPLATE.format(values=json.dumps(dataclasses.asdict(config))))
    return path


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


def absolute_paths(config: ExperimentConfig, cwd: str | pathlib.Path = ".") -> ExperimentConfig:
    """`config` with its file paths (`data.path`, `chaos`, `eval.sets`) resolved against `cwd`.

    Entry points call it before any child process starts: children run from elsewhere (the
    launcher's from the package's root), so a relative path must mean the caller's file.
    """
    base = pathlib.Path(cwd).absolute()

    def resolve(path: str) -> str:
        return str(base / pathlib.Path(path).expanduser()) if path else path

    sets = ",".join(f"{n}={resolve(p)}" for n, p in eval_sets(config.eval.sets).items())
    return dataclasses.replace(
        config,
        chaos=resolve(config.chaos),
        data=dataclasses.replace(config.data, path=resolve(config.data.path)),
        eval=dataclasses.replace(config.eval, sets=sets),
    )


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


def validate(config: ExperimentConfig, device_count: int | None = None) -> None:
    """Checks every field that could only fail later, naming the field.

    Args:
      config: the configuration to check.
      device_count: devices available to this process; when given, also checks that
        `num_learners` meshes of `mesh.shape` fit on them.

    Raises:
      ConfigError: the first field that cannot work.
    """
    check(config, device_count)
