"""The public surface: what IDEs see is what `dd.X` gives, `__version__`, and a light import."""

import ast
import subprocess
import sys
import tomllib

import decoupled_diloco as dd
from tests.helpers import ROOT


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """{public name: (module, its name there)} from the `if TYPE_CHECKING:` block."""
    tree = ast.parse((ROOT / "decoupled_diloco" / "__init__.py").read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def test_the_names_ides_see_are_the_exports():
    exports = {
        name: target if isinstance(target, tuple) else (target, name)
        for name, target in dd._EXPORTS.items()
    }
    assert _type_checking_imports() == exports
    assert set(dd.__all__) == {"__version__", *exports}


def test_version_is_the_packages():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dd.__version__ == version


def test_importing_the_package_does_not_start_jax():
    code = "import sys, decoupled_diloco as dd; dd.ExperimentConfig; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # the config needs no JAX; it loads on first use


def test_a_client_of_the_wrong_shard_count_is_refused_by_decoupled_sync():
    import jax.numpy as jnp
    import pytest

    from tests.conftest import tiny_config

    config = tiny_config(mode="decoupled", **{"decoupled.syncer.shards": 2})
    one = dd.SyncerClient("127.0.0.1:1", config.decoupled.syncer, "t")
    try:
        params = {"w": jnp.zeros((4, 4))}
        with pytest.raises(ValueError, match=r"1 syncer shard\(s\).*shards=2"):
            dd.DecoupledSync(config, 0, client=one, params=params)
    finally:
        one.close()
    two = dd.syncer_client("127.0.0.1:1,127.0.0.1:2", config.decoupled.syncer, "t")
    assert len(two.clients) == 2  # what DecoupledSync(client=) takes with 2 shards
    two.close()
