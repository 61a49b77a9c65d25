"""Real corpora: tokenizers, the prepare step, packed windows, and every bad input named."""

import json
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decoupled_diloco import config as config_lib
from decoupled_diloco import tasks
from decoupled_diloco.data import dataset as dataset_lib
from decoupled_diloco.data import packed, prepare, shards, sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.data.text import default_corpus_root, is_validation
from decoupled_diloco.models.mesh import make_island_mesh
from tests.conftest import tiny_config
from tests.helpers import ROOT, wait_until

TEXT = "Packing keeps documents apart. Ünïcode too: 日本語, emoji 🙂.\nSecond line.\n"


def _stdlib_texts(limit=40):
    files = sorted((default_corpus_root() / "json").glob("*.py"))
    files += sorted((default_corpus_root() / "email").glob("*.py"))
    return [f.read_text() for f in files[:limit]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return tokenizer_lib.train_bpe(_stdlib_texts(), 400, path)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import sentencepiece as spm

    directory = tmp_path_factory.mktemp("spm")
    (directory / "text.txt").write_text("\n".join(_stdlib_texts(20)))
    spm.SentencePieceTrainer.train(
        input=str(directory / "text.txt"),
        model_prefix=str(directory / "sp"),
        vocab_size=300,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    return directory / "sp.model"


def _jsonl(path, texts, extra_lines=()):
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def test_each_tokenizer_round_trips_text(bpe, sentencepiece_model):
    plain = "def f(x):\n    return x + 1  # a comment\n"
    for tok in (tokenizer_lib.load_tokenizer("bytes"), bpe):
        for text in (TEXT, plain):
            (ids,) = tok.encode_batch([text])
            assert tok.decode(ids) == text, tok.kind
    sp = tokenizer_lib.load_tokenizer(str(sentencepiece_model))
    words = "the message parser returns a header value"
    assert sp.decode(sp.encode_batch([words])[0]) == words
    assert sp.eos_id == 2 and sp.vocab_size == 300
    # The digest names the file's bytes: the same file twice, another file another digest.
    again = tokenizer_lib.load_tokenizer(str(bpe.path))
    assert again.digest == bpe.digest and again.digest.startswith("hf:")
    assert sp.digest != bpe.digest
    assert bpe.eos_id == bpe._tokenizer.token_to_id(tokenizer_lib.BPE_EOS)


def test_bad_tokenizers_are_named(tmp_path):
    with pytest.raises(tokenizer_lib.TokenizerError, match="no such file"):
        tokenizer_lib.load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(tokenizer_lib.TokenizerError, match="not a HF tokenizer.json"):
        tokenizer_lib.load_tokenizer(str(tmp_path / "bad.json"))
    (tmp_path / "x.vocab").write_text("a")
    with pytest.raises(tokenizer_lib.TokenizerError, match="unknown kind"):
        tokenizer_lib.load_tokenizer(str(tmp_path / "x.vocab"))


def test_windows_carry_segment_ids_and_positions_of_a_hand_built_corpus(tmp_path):
    docs = ["ab", "cde", "f", "ghij", "klmnopq", "r", "stu", "vw", "xyz", "0123", "45", "6789"]
    path = _jsonl(tmp_path / "docs.jsonl", docs)
    # shard_tokens=6: shard boundaries fall inside windows.
    manifest = prepare.prepare(
        [str(path)],
        tmp_path / "out",
        "bytes",
        shard_tokens=6,
        val_fraction=0.25,
        log=lambda _: None,
    )
    held_out = [is_validation(f"docs.jsonl:{i + 1}", 0.25) for i in range(len(docs))]
    train = [d for d, v in zip(docs, held_out, strict=True) if not v]
    assert any(held_out) and len(train) >= 8
    assert manifest["totals"]["train"]["documents"] == len(train)
    assert len([s for s in manifest["shards"] if s["split"] == "train"]) > 2
    # The stream by hand: each document's bytes, then 256; its starts; positions within it.
    stream, starts = [], []
    for d in train:
        starts.append(len(stream))
        stream += [*d.encode(), 256]
    data = packed.PreparedDataset(tmp_path / "out", seq_len=4)
    windows = data.windows["train"]
    assert len(windows) == (len(stream) - 1) // 4
    for i in range(len(windows)):
        lo = 4 * i
        want_seg = [sum(lo < s <= lo + t for s in starts) for t in range(5)]
        segment_start = [max([lo] + [s for s in starts if s <= lo + t]) - lo for t in range(5)]
        got = windows[i]
        np.testing.assert_array_equal(got["tokens"], stream[lo : lo + 5])
        np.testing.assert_array_equal(got["segment_ids"], want_seg)
        np.testing.assert_array_equal(got["positions"], np.arange(5) - segment_start)
    # The first documents literally: "ab" 256 | "cde" 256 | ... (when both are training ones).
    if train[:2] == ["ab", "cde"]:
        np.testing.assert_array_equal(windows[0]["segment_ids"], [0, 0, 0, 1, 1])
        np.testing.assert_array_equal(windows[0]["positions"], [0, 1, 2, 0, 1])
    # Shards open with numpy alone: the first train shard is the stream's start.
    first = np.load(tmp_path / "out" / "train-00000.npy")
    assert first.dtype == np.uint16 and list(first) == stream[: len(first)]


@pytest.mark.parametrize("kind", ["transformer", "moe"])
def test_a_tokens_logits_do_not_change_when_another_document_in_its_window_changes(kind):
    cfg = config_lib.ModelConfig(
        vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_hidden=64, seq_len=12
    )
    from decoupled_diloco.models import moe
    from decoupled_diloco.models.transformer import Segments, Transformer

    mesh = make_island_mesh((1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):  # the sharding annotations need a mesh
        if kind == "moe":  # room for every token: a full expert would couple the documents
            model = moe.MoETransformer(cfg, config_lib.MoEConfig(capacity_factor=4.0), nnx.Rngs(0))
        else:
            model = Transformer(cfg, nnx.Rngs(0))

    def logits(tokens, segment_ids, positions):
        segments = Segments(jnp.asarray([segment_ids]), jnp.asarray([positions]))
        with jax.set_mesh(mesh):
            out = model(jnp.asarray([tokens]), segments)
        return np.asarray(out[0] if kind == "moe" else out)[0]

    seg = [0] * 5 + [1] * 7
    pos = list(range(5)) + list(range(7))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 12)
    other_second = tokens.copy()
    other_second[5:] = rng.integers(0, 64, 7)
    other_first = tokens.copy()
    other_first[:5] = rng.integers(0, 64, 5)
    base = logits(tokens, seg, pos)
    np.testing.assert_allclose(logits(other_second, seg, pos)[:5], base[:5], atol=1e-5)
    np.testing.assert_allclose(logits(other_first, seg, pos)[5:], base[5:], atol=1e-5)
    # The second document alone, at the window's start, gives the same logits too.
    alone = logits(tokens[5:], [0] * 7, list(range(7)))
    np.testing.assert_allclose(alone, base[5:], atol=1e-4)
    # Without the mask the first document's tokens do reach the second's logits.
    unmasked = [0] * 12, list(range(12))
    assert not np.allclose(logits(other_first, *unmasked)[5:], logits(tokens, *unmasked)[5:])


def _prepare_cmd(inputs, out, tokenizer, *extra):
    flags = [f"--input={i}" for i in inputs] + [f"--output={out}", f"--tokenizer={tokenizer}"]
    return [sys.executable, "-m", "decoupled_diloco.data.prepare", *flags, *extra]


def _feed(fifo, data, done):
    """Writes `data` into the named pipe `fifo` (blocks until a reader opens it)."""
    try:
        with open(fifo, "wb") as f:
            f.write(data)
            done.wait(300)  # held open: the reader waits for more until the test lets go
    except BrokenPipeError:  # the reader was killed
        pass


@pytest.mark.multiprocess
def test_a_killed_prepare_resumes_without_redoing_finished_shards_and_gives_the_same_ones(
    tmp_path,
):
    """The input is a named pipe that the test feeds: the prepare cannot finish before it is
    killed, whatever the machine's speed; then it is fed the whole input again."""
    texts = _stdlib_texts(60)
    lines = [
        json.dumps({"text": f"document {i}\n" + texts[i % len(texts)][:3000]}) + "\n"
        for i in range(4000)
    ]
    data = "".join(lines).encode()
    half = len("".join(lines[:2400]).encode())  # > one read-ahead batch (4 MB)
    assert half > prepare.BATCH_BYTES
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "big.jsonl").write_bytes(data)
    fifo = tmp_path / "big.jsonl"
    os.mkfifo(fifo)
    args = ("--shard_tokens=300000", "--val_fraction=0.05")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    killed = tmp_path / "killed"
    ledger = killed / prepare.LEDGER
    done = threading.Event()
    feeder = threading.Thread(target=_feed, args=(fifo, data[:half], done))
    feeder.start()
    proc = subprocess.Popen(
        _prepare_cmd([fifo], killed, "bytes", *args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: ledger.exists() and len(ledger.read_text().splitlines()) >= 3,
            120,
            "two finished shard groups",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        done.set()
        feeder.join()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / shards.MANIFEST).exists()
    finished = {p.name: p.stat().st_mtime_ns for p in killed.glob("*-0000[01]*.npy")}
    assert len(finished) >= 4  # two groups' train and validation shards with their indexes
    done = threading.Event()
    done.set()
    feeder = threading.Thread(target=_feed, args=(fifo, data, done))
    feeder.start()
    try:
        resumed = subprocess.run(
            _prepare_cmd([fifo], killed, "bytes", *args),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        feeder.join(timeout=60)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming after" in resumed.stdout, resumed.stdout
    assert {p: (killed / p).stat().st_mtime_ns for p in finished} == finished  # not rewritten
    whole = prepare.prepare(
        [str(tmp_path / "file" / "big.jsonl")],
        tmp_path / "whole",
        shard_tokens=300000,
        val_fraction=0.05,
        log=lambda _: None,
    )
    got = json.loads((killed / shards.MANIFEST).read_text())
    assert got["shards"] == whole["shards"] and len(whole["shards"]) > 6
    for entry in whole["shards"]:
        a, b = (d / f"{entry['name']}.npy" for d in (killed, tmp_path / "whole"))
        assert a.read_bytes() == b.read_bytes()


def test_bad_jsonl_lines_are_counted_and_strict_refuses_them(tmp_path):
    path = _jsonl(
        tmp_path / "c.jsonl",
        ["one", "two", "three"] * 20,
        extra_lines=["{not json", json.dumps({"body": "x"}), json.dumps([1]), ""],
    )
    lines = []
    manifest = prepare.prepare([str(path)], tmp_path / "out", val_fraction=0.2, log=lines.append)
    assert manifest["skipped"]["counts"] == {"not JSON": 1, "no text field 'text'": 2}
    assert "c.jsonl:61: not JSON" in manifest["skipped"]["examples"][0]
    assert any("skipped 3 lines" in line for line in lines)
    with pytest.raises(sources.SourceError, match="c.jsonl:61: not JSON.*--strict"):
        prepare.prepare([str(path)], tmp_path / "strict", strict=True, log=lambda _: None)


def test_parquet_columns_and_zst_jsonl_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [f"row {i} " * (i + 1) for i in range(50)]
    pq.write_table(
        pa.table({"body": texts, "n": list(range(50))}), tmp_path / "t.parquet", row_group_size=7
    )
    with pytest.raises(sources.SourceError, match="no column 'text'.*--text_field"):
        prepare.prepare([str(tmp_path / "t.parquet")], tmp_path / "a", log=lambda _: None)
    m = prepare.prepare(
        [str(tmp_path / "t.parquet")],
        tmp_path / "b",
        text_field="body",
        val_fraction=0.2,
        log=lambda _: None,
    )
    assert sum(t["documents"] for t in m["totals"].values()) == 50
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "t.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    z = prepare.prepare(
        [str(tmp_path / "t.jsonl.zst")], tmp_path / "z", val_fraction=0.2, log=lambda _: None
    )
    assert z["totals"]["train"]["tokens"] == m["totals"]["train"]["tokens"] or (
        z["totals"]["train"]["documents"] + z["totals"]["val"]["documents"] == 50
    )


def test_an_empty_corpus_and_an_unfinished_or_foreign_directory_are_refused(tmp_path):
    path = _jsonl(tmp_path / "empty.jsonl", [], extra_lines=[json.dumps({"x": 1})])
    with pytest.raises(prepare.PrepareError, match="no training document"):
        prepare.prepare([str(path)], tmp_path / "e", log=lambda _: None)
    with pytest.raises(shards.PreparedDataError, match="no manifest.json"):
        packed.PreparedDataset(tmp_path / "e", seq_len=8)
    with pytest.raises(sources.SourceError, match="no such file"):
        prepare.prepare([str(tmp_path / "nope.jsonl")], tmp_path / "n", log=lambda _: None)


def _prepare_docs(out, tokenizer, shard_tokens=1 << 26):
    """120 short documents prepared into `out` with `tokenizer`."""
    docs = [f"document {i}: " + "some words of text " * (i % 7 + 3) for i in range(120)]
    out.mkdir(parents=True)
    source = _jsonl(out.parent / f"{out.name}.jsonl", docs)
    prepare.prepare([str(source)], out, tokenizer, val_fraction=0.2, shard_tokens=shard_tokens,
                    log=lambda _: None)  # fmt: skip
    return out


@pytest.fixture
def prepared(tmp_path):
    return _prepare_docs(tmp_path / "prepared", "bytes", shard_tokens=3000)


def test_a_truncated_or_corrupted_shard_or_another_version_is_named(prepared):
    packed.PreparedDataset(prepared, seq_len=16)  # intact
    shard = prepared / "train-00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])
    with pytest.raises(shards.PreparedDataError, match="train-00001.npy: truncated"):
        packed.PreparedDataset(prepared, seq_len=16)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(shards.PreparedDataError, match="train-00001.npy: its SHA-256"):
        packed.PreparedDataset(prepared, seq_len=16)
    packed.PreparedDataset(prepared, seq_len=16, verify=False)  # sizes only: opens
    shard.write_bytes(data)
    manifest = json.loads((prepared / shards.MANIFEST).read_text())
    (prepared / shards.MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(shards.PreparedDataError, match="format version 99"):
        packed.PreparedDataset(prepared, seq_len=16)


def test_the_vocabulary_comes_from_the_tokenizer_and_a_different_one_is_refused(prepared):
    config = tiny_config(**{"data.path": str(prepared)})
    task = tasks.make_task(config)
    assert task.abstract_params()["embed"]["embedding"].shape[0] == 384  # 257 padded
    assert dataset_lib.model_vocab_size(config) == 384
    assert dataset_lib.model_vocab_size(config_lib.replace(config, **{"model.vocab_size": 257}))
    with pytest.raises(config_lib.ConfigError, match="vocab_size=256 differs.*vocabulary 257"):
        tasks.make_task(config_lib.replace(config, **{"model.vocab_size": 256}))


def test_too_little_data_for_a_batch_per_learner_says_so(prepared):
    data = packed.PreparedDataset(prepared, seq_len=16)
    with pytest.raises(ValueError, match="fewer than one batch of 512"):
        data.train_iterator(512, 0, 8, seed=0)
    with pytest.raises(ValueError, match="validation split.*windows"):
        data.validation_batches(64, 100)


def test_a_data_position_saved_on_other_data_is_refused(tmp_path, prepared, bpe):
    data = packed.PreparedDataset(prepared, seq_len=16)
    it = data.train_iterator(4, 0, 2, seed=0)
    next(it)
    state = it.get_state()
    assert state["tokenizer"] == "bytes:v1"
    again = data.train_iterator(4, 0, 2, seed=0)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["tokens"], next(it)["tokens"])
    other = _prepare_docs(tmp_path / "other", str(bpe.path))
    foreign = packed.PreparedDataset(other, seq_len=16).train_iterator(4, 0, 2, seed=0)
    with pytest.raises(packed.DataMismatchError, match="tokenized by 'bytes:v1'"):
        foreign.set_state(state)


def test_a_run_resumed_on_data_of_another_tokenizer_is_refused(tmp_path, prepared, bpe):
    config = tiny_config(
        mode="dp",
        num_learners=1,
        train_steps=4,
        **{
            "data.path": str(prepared),
            "checkpoint.every": 2,
            "eval.batches": 1,
            "data.batch_size": 4,
        },
    )
    from decoupled_diloco.train import train_and_evaluate

    result = train_and_evaluate(config, tmp_path / "run")
    assert result.summary["corpus"]["tokenizer_digest"] == "bytes:v1"
    assert np.isfinite(result.summary["final_eval_loss"])
    other = _prepare_docs(tmp_path / "other", str(bpe.path))
    moved = config_lib.replace(config, **{"data.path": str(other)})
    with pytest.raises(config_lib.ConfigError, match="tokenized by 'bytes:v1'.*fresh workdir"):
        train_and_evaluate(moved, tmp_path / "run")


def test_bits_per_byte_counts_the_text_the_validation_targets_stand_for(tmp_path, bpe):
    import math

    from decoupled_diloco.data.heldout import held_out

    by_bytes = packed.PreparedDataset(_prepare_docs(tmp_path / "b", "bytes"), seq_len=32)
    held = held_out(by_bytes, batch_size=4, num_batches=2)
    targets = np.concatenate([b["tokens"][:, 1:].ravel() for b in held.batches])
    assert held.targets == 2 * 4 * 32 == targets.size
    assert held.nbytes == int((targets != 256).sum())  # a byte a token; the end of a doc: none

    by_bpe = packed.PreparedDataset(_prepare_docs(tmp_path / "p", str(bpe.path)), seq_len=32)
    held = held_out(by_bpe, batch_size=4, num_batches=2)
    ids = np.concatenate([b["tokens"][:, 1:].ravel() for b in held.batches])
    raw = bpe._tokenizer  # byte-level BPE: a token's string has one character per byte
    expected = sum(len(raw.id_to_token(int(i))) for i in ids if int(i) != bpe.eos_id)
    assert held.nbytes == expected and expected > held.targets  # more than a byte a token
    bpb = held.with_bpb({"loss": 1.5})["bpb"]
    assert bpb == pytest.approx(1.5 * held.targets / math.log(2) / expected)
