"""Tests of the goodput simulator's command line and its failure mode on hopeless settings."""

import dataclasses
import json

import pytest

from decoupled_diloco.sim import SimConfig, simulate
from decoupled_diloco.sim import goodput_cli as simulate_goodput


def test_json_echoes_inputs_and_reports_every_system(capsys):
    simulate_goodput.main(["--json", "--total_tokens=2e10", "--num_chips=2400000"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"dp", "elastic_dp", "decoupled", "inputs"}
    for system in ("dp", "elastic_dp", "decoupled"):
        assert 0.0 < out[system]["goodput"] <= out[system]["uptime"] <= 1.0, system
    assert out["inputs"]["num_chips"] == 2_400_000
    assert out["inputs"]["total_tokens"] == 2e10
    assert set(out["inputs"]) == {f.name for f in dataclasses.fields(SimConfig)}
    assert out["dp"]["goodput"] < out["elastic_dp"]["goodput"] < out["decoupled"]["goodput"]


def test_boolean_policy_flags(capsys):
    argv = ["--json", "--total_tokens=2e10", "--systems=decoupled"]
    simulate_goodput.main(argv)
    base = json.loads(capsys.readouterr().out)
    simulate_goodput.main([*argv, "--salvage_on_failure", "--background_upscale=true"])
    policy = json.loads(capsys.readouterr().out)
    assert policy["inputs"]["salvage_on_failure"] is True
    assert policy["decoupled"]["goodput"] > base["decoupled"]["goodput"]


def test_sweep_writes_plot_and_table(tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    simulate_goodput.main(
        [
            "--sweep",
            f"--plot={plot}",
            "--sweep_chips=150000,600000",
            "--sweep_learners=2,8",
            "--total_tokens=1e10",
        ]
    )
    table = capsys.readouterr().out
    assert plot.stat().st_size > 10_000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.count("decoupled") == 4  # 2 chip counts x 2 learner counts
    assert table.count("elastic_dp") == 2


def test_hopeless_dp_raises_instead_of_growing_forever():
    # A 600 s checkpoint against a 13 s cluster MTBF: a checkpoint essentially never completes,
    # so DP never finishes; the simulator must say so instead of doubling its horizon forever.
    cfg = SimConfig(num_chips=2_400_000, checkpoint_s=600.0, total_tokens=1e9)
    with pytest.raises(ValueError, match="goodput below"):
        simulate(cfg, ("dp",))


def test_the_simulator_and_planner_are_one_command_of_the_package():
    import json
    import subprocess
    import sys

    def run(*argv):
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)

    plan = run(
        "-m", "decoupled_diloco.sim", "bandwidth", "--params=1B", "--step_time_s=0.1", "--json"
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)
    old = run("-m", "tools.plan_bandwidth", "--params=1B", "--step_time_s=0.1", "--json")
    assert old.returncode == 0 and json.loads(old.stdout) == json.loads(plan.stdout)
    wrong = run("-m", "decoupled_diloco.sim", "planner")
    assert wrong.returncode == 2 and "unknown command 'planner'" in wrong.stdout
    assert "goodput" in wrong.stdout and "calibrate" in wrong.stdout
