"""A trained model used from outside: exported, read without this package, loaded, sampled."""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import decoupled_diloco as dd
from decoupled_diloco import config as config_lib
from decoupled_diloco import export
from decoupled_diloco.data import prepare
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.data.dataset import TextDataset
from decoupled_diloco.models.decode import GenerationError
from tests.conftest import tiny_config
from tests.helpers import ROOT

# Reads an export with orbax and safetensors only, and proves it did not import us.
READER = """
import json, sys
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import load_file
out = sys.argv[1]
flat = load_file(out + "/model.safetensors")
restored = ocp.StandardCheckpointer().restore(out + "/params")
same = all(np.array_equal(np.asarray(restored[k]), v) for k, v in flat.items())
assert not [m for m in sys.modules if m.startswith("decoupled_diloco")]
np.savez(sys.argv[2], **{k.replace("/", "|"): v for k, v in flat.items()})
print(json.dumps({"same": same, "keys": len(flat)}))
"""


def _python(*args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("run")
    result = dd.train_and_evaluate(tiny_config(mode="diloco"), workdir, corpus=corpus)
    return workdir, result


def test_an_export_is_the_runs_parameters_readable_without_the_framework(run, tmp_path):
    workdir, result = run
    out = tmp_path / "exported"
    done = _python("-m", "decoupled_diloco.export", f"--workdir={workdir}", f"--out={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parameters of a diloco run" in done.stdout
    read = _python("-c", READER, str(out), str(tmp_path / "tensors.npz"))
    assert read.returncode == 0, read.stderr[-2000:]
    assert json.loads(read.stdout.splitlines()[-1])["same"]  # Orbax and safetensors agree
    tensors = np.load(tmp_path / "tensors.npz")
    mine = export.flat_params(result.params)
    assert sorted(k.replace("|", "/") for k in tensors.files) == sorted(mine)
    for key, value in mine.items():
        np.testing.assert_array_equal(tensors[key.replace("/", "|")], value)
    info = json.loads((out / "model.json").read_text())
    assert info["mode"] == "diloco" and info["steps_done"] == 8
    assert info["final_eval_bpb"] == pytest.approx(result.summary["final_eval_bpb"])
    assert info["tokenizer"]["kind"] == "bytes"


def test_a_loaded_model_evaluates_as_the_run_did_and_samples(run, corpus):
    workdir, result = run
    trained = dd.load_model(workdir)
    island = dd.Island(trained.config, jax.devices()[:1], mesh_shape=(1, 1))
    params = nnx.to_pure_dict(nnx.state(trained.model, nnx.Param))
    held = TextDataset(corpus, trained.config.model.seq_len).validation_batches(8, 2)
    loss = island.evaluate_metrics(params, held)["loss"]
    assert loss == pytest.approx(result.summary["final_eval_loss"], rel=1e-5)
    greedy = dd.generate(trained, "def ", max_new_tokens=8, temperature=0.0)
    assert isinstance(greedy, str)
    batch = dd.generate(trained, ["def ", "import"], max_new_tokens=8, temperature=0.0)
    assert batch[0] == greedy  # a prompt decodes the same alone or in a batch
    dd.generate(trained, "for ", max_new_tokens=8, temperature=0.0)  # (the same shape)
    assert trained.decoder().compiles == 4  # per shape (1 and 2 prompts), not per call


def test_the_sample_command_prints_continuations_and_names_bad_input(run, tmp_path):
    workdir, _ = run
    done = _python(
        "-m", "decoupled_diloco.sample", f"--workdir={workdir}", "--prompt=def ",
        "--prompt=class ", "--max_new_tokens=6", "--temperature=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("def ") and "\nclass " in done.stdout
    bad = _python(
        "-m", "decoupled_diloco.sample", f"--workdir={workdir}", "--prompt=x",
        "--temperature=-1",
    )  # fmt: skip
    assert bad.returncode != 0 and "temperature=-1" in bad.stderr
    with pytest.raises(GenerationError, match="exceed the model's context of 32"):
        dd.generate(workdir, "x" * 40, max_new_tokens=4)
    with pytest.raises(export.ExportError, match="not a run's workdir"):
        dd.load_model(tmp_path)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(export.ExportError, match="a run without a saved model"):
        dd.load_model(tmp_path)


def test_a_bpe_run_keeps_its_tokenizer_and_a_missing_one_is_named(tmp_path, corpus):
    texts = [f"document {i}: " + "some words of text " * (i % 7 + 3) for i in range(200)]
    bpe = tokenizer_lib.train_bpe(texts, 300, tmp_path / "bpe" / "tokenizer.json")
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepared = tmp_path / "prepared"
    prepare.prepare([str(source)], prepared, str(bpe.path), val_fraction=0.2, log=lambda _: None)
    config = config_lib.replace(
        tiny_config(mode="dp", num_learners=1), **{"data.path": str(prepared)}
    )
    result = dd.train_and_evaluate(config, tmp_path / "run")
    loss, bpb = result.summary["final_eval_loss"], result.summary["final_eval_bpb"]
    assert 0 < bpb < loss / math.log(2)  # a BPE token stands for more than one byte
    trained = dd.load_model(tmp_path / "run")
    assert trained.tokenizer.digest == bpe.digest
    assert isinstance(dd.generate(trained, "document", 5, temperature=0.0), str)
    (tmp_path / "run" / "model" / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(export.ExportError, match="tokenizer file tokenizer/tokenizer.json"):
        dd.load_model(tmp_path / "run")


def test_export_never_overwrites_the_run_or_a_directory_of_something_else(run, tmp_path):
    workdir, _ = run
    for out in (workdir, workdir / "model" / "inside", workdir.parent):
        with pytest.raises(export.ExportError, match="inside or around it"):
            export.export(workdir, out)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(export.ExportError, match="holds something other than an export"):
        export.export(workdir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (workdir / "summary.json").exists() and (workdir / "model" / "model.json").exists()


def test_a_users_task_is_imported_only_when_asked(run, tmp_path):
    import shutil

    workdir, _ = run
    shutil.copytree(workdir / "model", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["task"] = "untrusted.module:make_task"  # loading would import it and run its code
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(export.ExportError, match="import_task=True"):
        dd.load_model(tmp_path / "model")
    with pytest.raises(config_lib.ConfigError, match="untrusted"):  # asked: imported (absent)
        dd.load_model(tmp_path / "model", import_task=True)
