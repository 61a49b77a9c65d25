"""The README's Python example runs as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_python_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["result"].summary["final_eval_loss"] < 5.0  # ln(256) = 5.55 untrained
    assert (tmp_path / "runs" / "api" / "summary.json").exists()
    report = (tmp_path / "runs" / "api" / "report.md").read_text()
    assert "final eval loss" in report and "report/eval_loss_tokens.png" in report


def test_every_public_name_resolves():
    import decoupled_diloco as dd

    missing = [name for name in dd.__all__ if getattr(dd, name, None) is None]
    assert missing == []
    assert set(dd.__all__) <= set(dir(dd))
