"""The README's Python example runs as written, in a fresh Python session."""

import os
import pathlib
import re
import subprocess
import sys

from tests.helpers import ROOT


def _fresh_python(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """`code` in a new interpreter with no XLA_FLAGS, as a user's session or notebook has."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_readme_python_example_runs_in_a_fresh_session(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    check = (
        "\nimport json, pathlib\n"
        "assert result.summary['final_eval_loss'] < 5.0  # ln(256) = 5.55 untrained\n"
        "print('SUMMARY', json.dumps(result.summary['num_learners']))\n"
    )
    done = _fresh_python(blocks[0] + check, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SUMMARY 2" in done.stdout
    assert (tmp_path / "runs" / "api" / "summary.json").exists()
    report = (tmp_path / "runs" / "api" / "report.md").read_text()
    assert "final eval loss" in report and "report/eval_loss_tokens.png" in report


def test_too_few_devices_after_jax_started_says_what_works(tmp_path):
    code = (
        "import jax, decoupled_diloco as dd\n"
        "jax.devices()  # JAX is up with 1 CPU device: XLA_FLAGS cannot act any more\n"
        "config = dd.ExperimentConfig(mode='dp', num_learners=2, train_steps=1,\n"
        "    model=dd.ModelConfig(d_model=32, num_layers=1, num_heads=2, mlp_hidden=64,\n"
        "    seq_len=32), data=dd.DataConfig(batch_size=4))\n"
        "try:\n"
        "    dd.train_and_evaluate(config, workdir=None)\n"
        "except dd.ConfigError as error:\n"
        "    print('ERROR', error)\n"
    )
    done = _fresh_python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR" in done.stdout, done.stdout
    message = done.stdout.split("ERROR", 1)[1]
    assert "already started in this process with 1" in message
    assert "restart the Python session" in message
    assert "dd.configure_cpu_devices(2)" in message


def test_every_public_name_resolves():
    import decoupled_diloco as dd

    missing = [name for name in dd.__all__ if getattr(dd, name, None) is None]
    assert missing == []
    assert set(dd.__all__) <= set(dir(dd))
