"""The accelerator check script runs anywhere: here at tiny size on CPU (issue 20)."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.multiprocess
def test_device_check_runs_at_tiny_size_and_writes_its_table(tmp_path):
    out = tmp_path / "gpu.md"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.device_check",
            "--sizes=tiny",
            "--steps=2",
            "--run_steps=8",
            f"--out={out}",
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    text = out.read_text()
    assert "## Device check (cpu)" in text and "Command: `python -m tools.device_check" in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny |"))
    assert row.split("|")[2].strip() == "xla"  # model.attention "auto" on a CPU
    framework, bare, ratio = (float(x) for x in row.split("|")[5:8])
    assert framework > 0 and bare > 0 and ratio > 0
    assert "Decoupled run, 2 learners of tiny" in text and "merges" in text
    assert (ROOT / "tools/device_check.sh").stat().st_mode & 0o111  # executable
