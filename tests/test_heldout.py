"""Held-out sets: the run's own and `eval.sets`, each with its loss and bits per byte."""

import json
import math

import pytest

import decoupled_diloco as dd
from decoupled_diloco import config as config_lib
from decoupled_diloco.data import prepare
from decoupled_diloco.data.text import default_corpus_root
from tests.conftest import tiny_config


def _docs(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_a_named_set_gets_its_own_curve_and_final_numbers(tmp_path):
    other = default_corpus_root() / "json"  # text files: read as bytes, its validation split
    config = config_lib.replace(tiny_config(mode="dp"), **{"eval.sets": f"json={other}"})
    summary = dd.train_and_evaluate(config, tmp_path).summary
    loss, bpb = summary["final_eval_json_loss"], summary["final_eval_json_bpb"]
    assert bpb == pytest.approx(loss / math.log(2))  # bytes: a token a byte
    assert summary["final_eval_bpb"] == pytest.approx(summary["final_eval_loss"] / math.log(2))
    assert loss != summary["final_eval_loss"]  # another text
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open() if "eval_json_loss" in x]
    assert len(lines) == 2 and all("eval_json_bpb" in x for x in lines)  # steps 4 and 8


@pytest.mark.parametrize(
    "sets, match",
    [
        ("json", "expected NAME=PATH"),
        ("a=x,a=y", "'a' is given twice"),
        ("my set=x", "expected NAME=PATH"),
    ],
)
def test_malformed_sets_are_refused_by_the_config(sets, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.replace(tiny_config(), **{"eval.sets": sets})


def test_a_set_that_cannot_be_read_with_the_runs_tokens_is_refused(tmp_path):
    texts = [f"document {i}: " + "words of text " * (i % 5 + 3) for i in range(80)]
    source = _docs(tmp_path / "docs.jsonl", texts)
    prepared_bytes = tmp_path / "bytes"
    prepare.prepare([str(source)], prepared_bytes, "bytes", val_fraction=0.3, log=lambda _: None)
    cases = [
        (f"gone={tmp_path / 'missing'}", "no such file or directory"),
        # A prepared directory holds end-of-document ids the byte corpus's model has none of.
        (f"prep={prepared_bytes}", "the byte corpus"),
    ]
    for sets, match in cases:
        config = config_lib.replace(tiny_config(mode="dp"), **{"eval.sets": sets})
        with pytest.raises(config_lib.ConfigError, match=match):
            dd.train_and_evaluate(config, None)
