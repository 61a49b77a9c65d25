"""The benchmark harness: sections and claims on disk, the headline table, and its rules."""

import ast
import json

import pytest

from tests.helpers import ROOT
from tools import run_benchmarks
from tools.benchkit import section as section_lib
from tools.benchkit.syncer import serving


def test_a_section_writes_its_text_and_its_claims_beside_it(tmp_path):
    argv = ["--steps=3", f"--out={section_lib.ROOT}/benchmarks/results/demo.md"]
    section = section_lib.Section("demo", argv=argv)
    section.claim("wall time", 12.5, unit="s", goal="≤ 300 s", met=True, headline=True)
    section.claim("wall time", 11.0, unit="s", goal="≤ 300 s", met=True, headline=True)
    out = tmp_path / "demo.md"
    section.write(out, f"## Demo\n\n{section.header()}\n")

    record = json.loads(out.with_suffix(".json").read_text())
    assert record["benchmark"] == "demo" and record["title"] == "Demo"
    command = "python -m tools.bench_demo --steps=3 --out=benchmarks/results/demo.md"
    assert record["command"] == command  # the repository's paths relative, as typed
    assert [c["value"] for c in record["claims"]] == [11.0]  # the same figure replaced
    assert command in out.read_text()
    (loaded,) = section_lib.load_claims(tmp_path)
    assert not loaded["stale"]


def test_a_section_rewritten_without_its_claims_is_marked_stale(tmp_path):
    section = section_lib.Section("demo", argv=[])
    section.claim("wall time", 12.0, unit="s", headline=True)
    section.write(tmp_path / "demo.md", "## Demo\n")
    (tmp_path / "demo.md").write_text("## Demo\n\nrewritten by hand\n")
    records = section_lib.load_claims(tmp_path)
    assert records[0]["stale"]
    assert "rewritten since" in "\n".join(section_lib.headline_table(records, ["demo"]))


def test_the_headline_table_keeps_reading_order_and_refuses_more_than_its_rows():
    def record(name, *values):
        claims = [{"figure": f"{name} {v}", "value": v, "headline": True} for v in values]
        return {"benchmark": name, "date": "2026-12-07 10:00", "claims": claims}

    rows = section_lib.headline_table([record("b", 1.5), record("a", 2)], ["b", "a"])
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["b 1.5", "a 2"]
    assert "**no**" not in rows[2] and "| - |" in rows[2]  # no goal: neither met nor missed
    with pytest.raises(ValueError, match="3 headline claims"):
        section_lib.headline_table([record("a", 1, 2, 3)], ["a"], limit=2)


def test_the_recorded_claims_make_a_headline_of_at_most_twenty_rows():
    records = section_lib.load_claims()
    assert {r["benchmark"] for r in records} >= {"quality", "decoupled", "chaos", "wan"}
    rows = section_lib.headline_table(records, run_benchmarks.READING_ORDER)
    assert 2 < len(rows) <= 22  # header, rule, ≤ 20 rows


def test_section_links_are_rewritten_for_results_md():
    text = "![a](wan.png) [b](../history/scale.md) [c](https://x.org/y) [d](#top)"
    assert run_benchmarks._relinked(text) == (
        "![a](results/wan.png) [b](history/scale.md) [c](https://x.org/y) [d](#top)"
    )


def test_no_bench_script_imports_another():
    scripts = sorted((ROOT / "tools").glob("bench_*.py"))
    names = {f"tools.{p.stem}" for p in scripts}
    offenders = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            offenders += [f"{path.stem} -> {m}" for m in modules if m in names]
    assert not offenders


def test_a_served_syncer_answers_and_is_reaped(tmp_path):
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.comm.client import SyncerClient

    config = config_lib.replace(
        config_lib.ExperimentConfig(mode="decoupled", num_learners=1),
        **{"model.d_model": 32, "model.num_layers": 1, "model.mlp_hidden": 64},
    )
    with serving(config, tmp_path, token="t0ken", timeout_s=240) as syncer:
        client = SyncerClient(syncer.address, config.decoupled.syncer, "t0ken")
        client.wait_ready(60)
        assert [f["version"] for f in client.status()["fragments"]] == [0] * 4
        client.close()
        proc = syncer.proc
    assert proc.poll() is not None  # reaped when the block ended


def test_a_syncer_that_cannot_start_is_reported_with_its_log(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit('this config is broken on purpose')\n")
    with pytest.raises(RuntimeError, match="syncer exited early"):
        with serving(broken, tmp_path, token="t", timeout_s=120):
            pass


def test_a_section_written_in_parts_keeps_every_parts_claims(tmp_path):
    out = tmp_path / "scale.md"
    first = section_lib.Section("scale", argv=["--section=syncer"])
    first.claim("peak", 2.4, unit="×", headline=True)
    first.append(out, "### Syncer\n")
    second = section_lib.Section("scale", argv=["--section=memory"])
    second.claim("compiled bytes", 7, unit="GB")
    second.append(out, "### Memory\n")
    (record,) = section_lib.load_claims(tmp_path)
    assert [c["figure"] for c in record["claims"]] == ["peak", "compiled bytes"]
    assert out.read_text() == "### Syncer\n\n### Memory\n" and not record["stale"]
