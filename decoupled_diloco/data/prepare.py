"""The prepare step: documents in, token shards out (`shards.py` says what is written).

    python -m decoupled_diloco.data.prepare --input=corpus.jsonl.zst --text_field=text \
        --tokenizer=tokenizer.json --output=data/mine
    dd.prepare(["corpus.jsonl.zst"], "data/mine", tokenizer="tokenizer.json")   # the same

It streams: one reader thread parses the inputs into batches of documents while the tokenizer
encodes the previous batch on every core (HF `encode_batch` and SentencePiece release the GIL),
so memory is one shard's tokens and a few batches whatever the input size. A shard group (a
train shard and the validation shard beside it) is closed once its train tokens reach
`shard_tokens`; boundaries depend on the documents alone, so a prepare that is killed and run
again with the same settings reads past the documents of its finished groups (recorded in
`prepare-ledger.jsonl`) without encoding them and writes the same shards an uninterrupted
prepare would.
"""

from __future__ import annotations

import json
import pathlib
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from decoupled_diloco.data import shards as shards_lib
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.data.text import is_validation

LEDGER = "prepare-ledger.jsonl"
BATCH_BYTES = 4 << 20  # text per encode_batch call
_QUEUED_BATCHES = 4


class PrepareError(ValueError):
    """A prepare that cannot run or finish; the message says why and what to change."""


def prepare(
    inputs: Sequence[str],
    output: str | pathlib.Path,
    tokenizer: str = "bytes",
    *,
    text_field: str = "text",
    val_fraction: float = 0.05,
    shard_tokens: int = 1 << 26,
    strict: bool = False,
    eos_token: str = "",
    split: str = "train",
    bpe_sample_mb: float = 256.0,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    progress_s: float = 10.0,
) -> dict[str, Any]:
    """Tokenizes `inputs` into a prepared directory `output`; returns its manifest.

    Args:
      inputs: files, folders and globs (text; JSONL, .gz, .zst; Parquet; HF `save_to_disk`).
      output: the prepared directory (created; resumed if it holds an unfinished prepare
        of the same settings).
      tokenizer: "bytes", a HF `tokenizer.json`, a SentencePiece `.model`, or "bpe:VOCAB" to
        train a byte-level BPE of that vocabulary on the training documents.
      text_field: the JSONL field or Parquet / dataset column that holds the text.
      val_fraction: share of documents held out for validation (by a hash of their key).
      shard_tokens: training tokens per shard.
      strict: refuse the first JSONL line or row without a text, instead of counting it.
      eos_token: the end-of-document token's text (default: the tokenizer's own).
      split: the split of a saved HF `DatasetDict`.
      bpe_sample_mb: "bpe:VOCAB": MB of training text the BPE is trained on (the first ones).
      overwrite: delete what `output` holds first (another prepare's shards).
      log: where progress and the report go.
      progress_s: seconds between progress lines.

    Raises:
      PrepareError: bad settings, an empty corpus, no validation document, or an `output`
        holding another prepare.
      sources.SourceError, tokenizer_lib.TokenizerError: an input or tokenizer that cannot
        be read.
    """
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"--val_fraction: must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise PrepareError(f"--shard_tokens: must be >= 1, got {shard_tokens}")
    output = pathlib.Path(output)
    if overwrite and output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    found = sources.expand_inputs(inputs)
    read = lambda: sources.DocumentReader(found, text_field, strict, split)  # noqa: E731
    tok = _tokenizer(tokenizer, eos_token, output, read, val_fraction, bpe_sample_mb, log)
    settings = {
        "version": shards_lib.VERSION,
        "inputs": sources.input_sizes(found),
        "tokenizer": tok.digest,
        "eos_id": tok.eos_id,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "split": split,
    }
    if shards_lib.is_prepared(output):
        manifest = shards_lib.read_manifest(output)
        if manifest.get("settings") == settings:
            log(f"prepare: {output} is already prepared with these settings")
            return manifest
        raise PrepareError(
            f"--output {output}: already holds a prepared corpus of other settings; choose "
            "another --output, or pass --overwrite to replace it"
        )
    done = _resume(output, settings, log)
    reader = read()
    dtype = shards_lib.token_dtype(tok.vocab_size)
    writers = {s: shards_lib.SplitWriter(output, s, dtype, tok.eos_id) for s in shards_lib.SPLITS}
    entries = [e for record in done for e in record["shards"]]
    documents = done[-1]["documents_end"] if done else 0
    group = len(done)
    meter = _Progress(reader, log, progress_s, documents)
    with open(output / LEDGER, "a") as ledger:
        for batch in _batches(reader, skip=documents):
            encoded = tok.encode_batch([d.text for d in batch])
            for document, ids in zip(batch, encoded, strict=True):
                held_out = is_validation(document.key, val_fraction)
                writers["val" if held_out else "train"].add(ids, len(document.text.encode()))
                documents += 1
                meter.documents, meter.tokens = documents, meter.tokens + len(ids) + 1
                if writers["train"].tokens >= shard_tokens:
                    entries += _close_group(writers, group, documents, ledger)
                    group += 1
            meter.maybe_show()
        if any(w.tokens for w in writers.values()):
            entries += _close_group(writers, group, documents, ledger)
    manifest = _manifest(entries, tok, dtype, settings, reader.skipped, documents)
    shards_lib.write_manifest(output, manifest)
    _report(output, manifest, time.monotonic() - meter.start, log)
    return manifest


def _tokenizer(spec, eos_token, output, read, val_fraction, bpe_sample_mb, log):
    """The run's tokenizer, its file copied into `output` (a BPE trained there first)."""
    if not spec.startswith("bpe:"):
        tok = tokenizer_lib.load_tokenizer(spec, eos_token)
        tok.save(output)
        return tok
    size = spec.partition(":")[2]
    if not size.isdigit():
        raise PrepareError(f"--tokenizer {spec!r}: expected bpe:VOCAB, e.g. bpe:8192")
    path = output / "tokenizer.json"
    if path.is_file():  # trained by this prepare before it was stopped
        return tokenizer_lib.HFTokenizer(path, tokenizer_lib.BPE_EOS)
    log(f"prepare: training a byte-level BPE of {int(size):,} tokens on <= {bpe_sample_mb} MB")
    limit = int(bpe_sample_mb * (1 << 20))

    def sample() -> Iterator[str]:
        taken = 0
        for document in read():
            if taken >= limit:
                return
            if not is_validation(document.key, val_fraction):
                taken += len(document.text)
                yield document.text

    tmp = output / "tokenizer.json.tmp"
    tokenizer_lib.train_bpe(sample(), int(size), tmp)
    tmp.replace(path)
    return tokenizer_lib.HFTokenizer(path, tokenizer_lib.BPE_EOS)


def _resume(output: pathlib.Path, settings: dict, log) -> list[dict]:
    """The finished groups recorded in the ledger (a new ledger if there is none)."""
    for stale in output.glob("*.tmp"):
        stale.unlink()
    path = output / LEDGER
    if not path.exists():
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return []
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if header.get("settings") != settings:
        raise PrepareError(
            f"--output {output}: holds an unfinished prepare of other settings (inputs, "
            "tokenizer, field, split or shard size); run it with those, choose another "
            "--output, or pass --overwrite"
        )
    done = []
    for line in lines[1:]:
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:  # the last line, cut by a kill: its group is redone
            break
    if done:
        log(
            f"prepare: resuming after {len(done)} finished shard groups "
            f"({done[-1]['documents_end']:,} documents)"
        )
    return done


def _batches(reader: sources.DocumentReader, skip: int) -> Iterator[list[sources.Document]]:
    """`reader`'s documents after the first `skip`, in batches of ~BATCH_BYTES, read ahead."""
    out: queue.Queue = queue.Queue(_QUEUED_BATCHES)
    stop = threading.Event()

    def produce() -> None:
        try:
            batch, size = [], 0
            for number, document in enumerate(reader):
                if number < skip:
                    continue
                batch.append(document)
                size += len(document.text)
                if size >= BATCH_BYTES:
                    out.put(batch)
                    batch, size = [], 0
                if stop.is_set():
                    return
            out.put(batch)
            out.put(None)
        except BaseException as error:  # handed to the consumer, raised there
            out.put(error)

    thread = threading.Thread(target=produce, name="prepare-reader", daemon=True)
    thread.start()
    try:
        while (item := out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            if item:
                yield item
    finally:
        stop.set()


def _close_group(writers, group: int, documents: int, ledger) -> list[dict]:
    """Writes group `group`'s shards and records it in the ledger; their manifest entries."""
    entries = [e for w in writers.values() if (e := w.flush(group)) is not None]
    ledger.write(json.dumps({"group": group, "documents_end": documents, "shards": entries}) + "\n")
    ledger.flush()
    return entries


def _manifest(entries, tok, dtype, settings, skipped, documents) -> dict[str, Any]:
    totals = {
        s: {
            k: sum(e[k] for e in entries if e["split"] == s)
            for k in ("documents", "tokens", "bytes")
        }
        for s in shards_lib.SPLITS
    }
    if not totals["train"]["tokens"]:
        raise PrepareError(
            f"the inputs hold no training document ({documents} documents read, "
            f"{skipped.total()} lines or rows without text)"
        )
    if not totals["val"]["tokens"]:
        raise PrepareError(
            f"no document was held out for validation ({documents} documents, val_fraction "
            f"{settings['val_fraction']}); raise --val_fraction or add documents (with --overwrite)"
        )
    return {
        "format": shards_lib.FORMAT,
        "version": shards_lib.VERSION,
        "tokenizer": {
            "kind": tok.kind,
            "digest": tok.digest,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "file": tok.file,
        },
        "dtype": dtype.name,
        "validation": "crc32(document key) % 10000 < val_fraction * 10000",
        "totals": totals,
        "skipped": {"counts": skipped.counts, "examples": skipped.examples},
        "shards": entries,
        "settings": settings,
    }


def _report(output, manifest, seconds, log) -> None:
    t, v = manifest["totals"]["train"], manifest["totals"]["val"]
    log(
        f"prepare: {output}: train {t['documents']:,} documents, {t['tokens']:,} tokens; "
        f"validation {v['documents']:,} documents, {v['tokens']:,} tokens; "
        f"{len(manifest['shards'])} shards in {seconds:.1f} s"
    )
    skipped = manifest["skipped"]
    if skipped["counts"]:
        log(
            f"prepare: skipped {sum(skipped['counts'].values()):,} lines or rows without text: "
            f"{skipped['counts']} (e.g. {'; '.join(skipped['examples'])}); --strict refuses them"
        )


class _Progress:
    """Documents, MB, tokens/s and the ETA, every `every_s` seconds."""

    def __init__(self, reader, log, every_s: float, documents: int):
        self.reader, self.log, self.every_s = reader, log, every_s
        self.documents, self.tokens = documents, 0
        self.start = self._last = time.monotonic()

    def maybe_show(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.start
        done, total = self.reader.bytes_read, max(self.reader.total_bytes, 1)
        eta = elapsed * (total - done) / max(done, 1)
        self.log(
            f"prepare: {self.documents:,} documents, {done / 1e6:,.1f} of {total / 1e6:,.1f} MB "
            f"({100 * done / total:.0f}%), {self.tokens / elapsed / 1e6:.2f}M tokens/s, "
            f"ETA {eta:.0f} s"
        )


def main(argv: Sequence[str]) -> None:
    """`python -m decoupled_diloco.data.prepare`: the flags are `prepare`'s arguments."""
    from absl import flags

    del argv
    f = flags.FLAGS
    try:
        prepare(
            f.input,
            f.output,
            f.tokenizer,
            text_field=f.text_field,
            val_fraction=f.val_fraction,
            shard_tokens=f.shard_tokens,
            strict=f.strict,
            eos_token=f.eos_token,
            split=f.split,
            bpe_sample_mb=f.bpe_sample_mb,
            overwrite=f.overwrite,
        )
    except (PrepareError, sources.SourceError, tokenizer_lib.TokenizerError) as error:
        sys.exit(f"prepare: {error}")


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_multi_string("input", None, "Files, folders or globs to read.", required=True)
    flags.DEFINE_string("output", None, "The prepared directory to write.", required=True)
    flags.DEFINE_string("tokenizer", "bytes", "bytes, a tokenizer.json, a .model, or bpe:VOCAB.")
    flags.DEFINE_string("text_field", "text", "JSONL field / Parquet column with the text.")
    flags.DEFINE_float("val_fraction", 0.05, "Share of documents held out for validation.")
    flags.DEFINE_integer("shard_tokens", 1 << 26, "Training tokens per shard.")
    flags.DEFINE_bool("strict", False, "Refuse JSONL lines / rows without text.")
    flags.DEFINE_string("eos_token", "", "End-of-document token (default: the tokenizer's).")
    flags.DEFINE_string("split", "train", "Split of a saved HF DatasetDict.")
    flags.DEFINE_float("bpe_sample_mb", 256.0, "bpe:VOCAB: MB of text the BPE is trained on.")
    flags.DEFINE_bool("overwrite", False, "Delete what --output holds first.")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
