"""Test set-up: 8 fake CPU devices and the persistent compile cache, before JAX starts."""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from decoupled_diloco.runtime import configure_cpu_devices  # noqa: E402

configure_cpu_devices(8)  # keeps the count above; adds XLA:CPU's long collective timeouts
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tiny models: XLA's optimisation passes cost more than running the programs they optimise.
# Children inherit it (tests hand them os.environ less XLA_FLAGS).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402


def tiny_config(**overrides) -> config_lib.ExperimentConfig:
    """A model small enough that a test step costs milliseconds."""
    base = config_lib.ExperimentConfig(
        mode="diloco",
        num_learners=2,
        inner_steps=4,
        train_steps=8,
        seed=0,
        log_every=4,
        model=config_lib.ModelConfig(
            d_model=32, num_layers=1, num_heads=2, mlp_hidden=64, seq_len=32
        ),
        data=config_lib.DataConfig(batch_size=8),
        optim=config_lib.OptimConfig(lr=3e-3, warmup_steps=2),
        eval=config_lib.EvalConfig(every=4, batches=2),
    )
    return config_lib.replace(base, **overrides) if overrides else base


@pytest.fixture(scope="session")
def corpus():
    from decoupled_diloco.data import text as data

    return data.load_corpus()


@pytest.fixture(scope="session")
def prepared_stdlib(tmp_path_factory):
    """Two standard-library folders prepared with the bytes tokenizer (a real corpus on disk)."""
    from decoupled_diloco.data import prepare
    from decoupled_diloco.data.text import default_corpus_root

    out = tmp_path_factory.mktemp("prepared") / "stdlib"
    root = default_corpus_root()
    prepare.prepare([str(root / "email"), str(root / "json")], out, "bytes",
                    shard_tokens=1 << 18, log=lambda _: None)  # fmt: skip
    return out


def pytest_collection_modifyitems(config, items):
    """Tests that start processes first: the two workers of `make test` (pytest-xdist, handing
    out one test at a time: `--maxschedchunk=1`) then take the long ones early and fill in with
    the short ones, instead of ending on a long tail."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)
