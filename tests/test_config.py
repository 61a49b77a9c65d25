"""Bad configs fail before compilation with messages naming the field."""

import importlib.util

import jax
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.config import ConfigError
from tests.helpers import ROOT


def _load_config_file(name):
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "experiments" / "configs" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"mode": "async"}, "config.mode"),
        ({"inner_steps": 0}, "config.inner_steps"),
        ({"num_learners": 0}, "config.num_learners"),
        ({"outer.merge": "median"}, "config.outer.merge"),
        ({"outer.momentum": 1.5}, "config.outer.momentum"),
        ({"mesh.shape": (3, 1)}, "config.data.batch_size"),
        ({"mesh.shape": (1, 3)}, "config.mesh.shape"),
        ({"model.num_heads": 3}, "config.model.num_heads"),
        ({"data.val_fraction": 0.0}, "config.data.val_fraction"),
        ({"model.dtype": "float8"}, "config.model.dtype"),
        ({"model.attention": "flash"}, "config.model.attention"),
    ],
)
def test_bad_field_is_named(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.replace(config_lib.ExperimentConfig(), **overrides)


def test_unknown_field_and_wrong_type_are_named():
    values = config_lib.as_config_dict(config_lib.ExperimentConfig()).to_dict()
    values["outer"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match=r"config\.outer\.lrr: no such field"):
        config_lib.from_config_dict(values)
    values = config_lib.as_config_dict(config_lib.ExperimentConfig()).to_dict()
    values["inner_steps"] = "fifty"
    with pytest.raises(ConfigError, match=r"config\.inner_steps: expected an integer"):
        config_lib.from_config_dict(values)


def test_more_learners_than_devices_is_named():
    config = config_lib.replace(
        config_lib.ExperimentConfig(), num_learners=5, **{"mesh.shape": (2, 1)}
    )
    with pytest.raises(ConfigError, match=r"config\.num_learners: 5 learners .* need 10 devices"):
        config_lib.validate(config, device_count=8)
    config_lib.validate(config, device_count=10)


def test_config_is_frozen_and_round_trips_through_config_dict():
    config = config_lib.ExperimentConfig()
    with pytest.raises(AttributeError):
        config.mode = "dp"
    cd = config_lib.as_config_dict(config)
    cd.outer.lr = 0.5
    cd.mesh.shape = (2, 1)
    rebuilt = config_lib.from_config_dict(cd)
    assert rebuilt.outer.lr == 0.5 and rebuilt.mesh.shape == (2, 1)
    assert rebuilt.model == config.model


def test_tiny_lm_config_matches_the_issue():
    config = config_lib.from_config_dict(_load_config_file("tiny_lm"))
    m = config.model
    assert (m.d_model, m.num_layers, m.num_heads, m.mlp_hidden, m.seq_len, m.vocab_size) == (
        128,
        2,
        4,
        512,
        128,
        0,  # from the data: 256 on the byte corpus
    )
    assert config.data.batch_size == 16 and config.optim.lr == 3e-3
    defaults = config_lib.OuterConfig()  # the framework default is DiLoCo's 0.7 / Nesterov 0.9
    assert (defaults.lr, defaults.momentum, defaults.nesterov) == (0.7, 0.9, True)


def test_every_config_file_loads_and_names_its_command():
    for path in sorted((ROOT / "experiments" / "configs").glob("*.py")):
        text = path.read_text()
        assert "python -m experiments.train" in text.split('"""')[1], path
        config_lib.from_config_dict(_load_config_file(path.stem))


def test_attention_auto_is_cudnn_only_for_16_bit_compute_on_gpus():
    from decoupled_diloco.models.transformer import attention_implementation

    assert jax.default_backend() == "cpu"
    assert attention_implementation("auto", "bfloat16") == "xla"  # on a CPU
    assert attention_implementation("auto", "float32") == "xla"
    assert attention_implementation("cudnn", "bfloat16") == "cudnn"  # asked for: as asked
    assert attention_implementation("xla", "bfloat16", head_dim=256) == "xla"


def test_the_launchers_children_share_accelerators_and_the_environment_wins(monkeypatch):
    from decoupled_diloco.local.commands import child_env

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert child_env("t")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    assert child_env("t")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
