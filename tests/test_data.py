"""Data: disjoint learner shards, exact iterator resume, deterministic split."""

import numpy as np
import pytest

from decoupled_diloco.data import text as data


def _window_starts(tokens, learner_id, num_learners, steps):
    # Tag every position with its own index so a window reveals where it was cut.
    ds = data.learner_dataset(
        tokens, seq_len=8, batch_size=4, learner_id=learner_id, num_learners=num_learners, seed=0
    )
    return {int(w[0]) for i in range(steps) for w in ds[i]}


def test_learner_shards_are_disjoint_and_cover_the_windows():
    tokens = np.arange(8 * 96 + 1, dtype=np.int64)
    shards = [_window_starts(tokens, i, 3, steps=8) for i in range(3)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not shards[i] & shards[j]
    assert set().union(*shards) == set(range(0, 8 * 96, 8))


def test_iterator_resumes_exactly(corpus):
    it = data.train_iterator(corpus.train_BN, 32, 4, learner_id=1, num_learners=2, seed=3)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    resumed = data.train_iterator(corpus.train_BN, 32, 4, learner_id=1, num_learners=2, seed=3)
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


def test_split_is_deterministic_and_by_file(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i} " * 50)
    a = data.load_corpus(str(tmp_path), val_fraction=0.2)
    b = data.load_corpus(str(tmp_path), val_fraction=0.2)
    np.testing.assert_array_equal(a.train_BN, b.train_BN)
    np.testing.assert_array_equal(a.val_BN, b.val_BN)
    assert a.num_files == 40 and 0 < len(a.val_BN) < len(a.train_BN)
    val_text = a.val_BN.tobytes().decode()
    train_text = a.train_BN.tobytes().decode()
    for i in range(40):
        marker = f"file {i} file"
        assert (marker in val_text) != (marker in train_text)  # each file on exactly one side


def test_default_corpus_is_the_stdlib(corpus):
    assert corpus.num_files > 100
    assert b"def " in corpus.train_BN[:200_000].tobytes()
    assert corpus.val_BN.size > 10_000


def test_single_file_and_missing_path(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abc" * 1000)
    corpus = data.load_corpus(str(path), val_fraction=0.1)
    assert len(corpus.train_BN) == 2700 and len(corpus.val_BN) == 300
    with pytest.raises(FileNotFoundError, match="config.data.path"):
        data.load_corpus(str(tmp_path / "nope"))


def test_validation_batches_are_fixed_and_checked(corpus):
    a = data.validation_batches(corpus.val_BN, 32, 4, 3)
    b = data.validation_batches(corpus.val_BN, 32, 4, 3)
    assert len(a) == 3 and a[0].shape == (4, 33)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="config.eval.batches"):
        data.validation_batches(corpus.val_BN[:1000], 32, 4, 100)


def test_a_small_folder_still_holds_out_a_file(tmp_path):
    for i in range(11):  # the hash of 11 names at 5% holds none out
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i} " * 50)
    assert not any(data.is_validation(f"f{i:02d}.txt", 0.05) for i in range(11))
    a = data.load_corpus(str(tmp_path), val_fraction=0.05)
    b = data.load_corpus(str(tmp_path), val_fraction=0.05)
    np.testing.assert_array_equal(a.val_BN, b.val_BN)
    assert a.num_files == 11 and 0 < len(a.val_BN) < len(a.train_BN) / 5  # one file of 11


def test_structured_files_are_sent_to_prepare_not_read_as_bytes(tmp_path):
    from decoupled_diloco.config import ConfigError

    (tmp_path / "docs").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "docs" / name).write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match=r"0 text files \(counted: \.md, \.py.*\.jsonl.*prepare"):
        data.load_corpus(str(tmp_path / "docs"))
    for name in ("one.jsonl", "one.parquet", "one.jsonl.zst"):
        (tmp_path / name).write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="decoupled_diloco.data.prepare --input="):
            data.load_corpus(str(tmp_path / name))
