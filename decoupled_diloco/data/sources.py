"""Documents out of the files a user has: text, JSONL (plain, .gz, .zst), Parquet, HF datasets.

`read_documents` streams `Document`s in a fixed order (inputs in the order given, a folder's
files sorted), each with a key that names it stably (a file's path relative to the folder it was
found in, plus a line or row number), so the validation split, decided by a hash of the key, is
the same on every machine and does not depend on how many documents were read before it.

Memory is bounded whatever the input size: JSONL is read line by line, Parquet one row group at
a time, a text file larger than `TEXT_PIECE_BYTES` in pieces that end at a newline.

Lines that are not JSON, or rows that lack the text field, are counted in a `Skipped` (a few
named), never dropped silently; with `strict` the first one is an error.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import pathlib
from collections.abc import Iterator, Sequence

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_PIECE_BYTES = 64 << 20  # a text file's piece (one document each) when it is larger
_EXAMPLES = 5  # skipped lines named in the report


class SourceError(ValueError):
    """An input that cannot be read as documents; the message names the file and the reason."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: a stable key (what the validation split hashes) and its text."""

    key: str
    text: str


@dataclasses.dataclass
class Skipped:
    """Lines and rows that held no document, by reason, with the first few named."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, reason: str, where: str) -> None:
        """Counts one skipped line or row."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{where}: {reason}")

    def total(self) -> int:
        """How many were skipped."""
        return sum(self.counts.values())


@dataclasses.dataclass(frozen=True)
class Input:
    """One file (or saved HF dataset) to read, and the key prefix of its documents."""

    path: pathlib.Path
    key: str
    kind: str  # "text", "jsonl", "parquet" or "hf"

    def size(self) -> int:
        """Bytes on disk (for progress and the ETA)."""
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return self.path.stat().st_size


def _kind(path: pathlib.Path) -> str | None:
    name = path.name.lower()
    if any(name.endswith(s) for s in JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _is_hf_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")
    )


def expand_inputs(patterns: Sequence[str]) -> list[Input]:
    """The files that `patterns` (files, folders, globs) name, in order.

    A folder is walked (sorted) for text, JSONL and Parquet files by suffix; a folder written by
    HF `datasets.save_to_disk` is one input. A file named on its own of another suffix is text.

    Raises:
      SourceError: a pattern names nothing, or a folder holds no file of a known suffix.
    """
    inputs: list[Input] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else []
        paths = [pathlib.Path(m) for m in matches] or [pathlib.Path(pattern)]
        for path in paths:
            if not path.exists():
                raise SourceError(f"--input {pattern!r}: no such file or folder")
            if _is_hf_dataset(path):
                inputs.append(Input(path, path.name, "hf"))
            elif path.is_dir():
                found = [
                    Input(p, p.relative_to(path).as_posix(), _kind(p))
                    for p in sorted(path.rglob("*"))
                    if p.is_file() and _kind(p) is not None
                ]
                if not found:
                    known = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
                    raise SourceError(
                        f"--input {str(path)!r}: a folder with no file of a known suffix "
                        f"({', '.join(known)})"
                    )
                inputs.extend(found)
            else:
                inputs.append(Input(path, path.name, _kind(path) or "text"))
    return inputs


class DocumentReader:
    """Streams the documents of `inputs`; `bytes_read` says how far, for progress.

    Args:
      inputs: from `expand_inputs`.
      text_field: the JSONL field, Parquet column or dataset column holding the text.
      strict: refuse (raise) the first line or row without a document, instead of counting it.
      split: the split of a saved HF `DatasetDict` to read.
    """

    def __init__(
        self,
        inputs: Sequence[Input],
        text_field: str = "text",
        strict: bool = False,
        split: str = "train",
    ):
        self.inputs, self.text_field, self.strict, self.split = (
            list(inputs),
            text_field,
            strict,
            split,
        )
        self.skipped = Skipped()
        self.total_bytes = sum(i.size() for i in self.inputs)
        self._done_bytes = 0
        self._current: io.IOBase | None = None

    @property
    def bytes_read(self) -> int:
        """Input bytes (on disk, compressed where the file is) read so far."""
        current = self._current
        try:
            return self._done_bytes + (current.tell() if current is not None else 0)
        except (ValueError, OSError):  # closed between the two reads
            return self._done_bytes

    def __iter__(self) -> Iterator[Document]:
        for item in self.inputs:
            read = {"text": self._text, "jsonl": self._jsonl, "parquet": self._parquet}.get(
                item.kind, self._hf
            )
            yield from read(item)
            self._done_bytes += item.size()
            self._current = None

    def _skip(self, reason: str, where: str) -> None:
        if self.strict:
            raise SourceError(f"{where}: {reason} (--strict refuses it; drop --strict to count it)")
        self.skipped.add(reason, where)

    def _text(self, item: Input) -> Iterator[Document]:
        with open(item.path, "rb") as raw:
            self._current = raw
            size = item.path.stat().st_size
            if size <= TEXT_PIECE_BYTES:
                yield Document(item.key, self._decode(raw.read(), item.path))
                return
            piece, rest = 0, b""
            while True:
                block = raw.read(TEXT_PIECE_BYTES)
                data = rest + block
                if not block:
                    if data:
                        yield Document(f"{item.key}#{piece}", self._decode(data, item.path))
                    return
                cut = data.rfind(b"\n") + 1 or len(data)
                data, rest = data[:cut], data[cut:]
                yield Document(f"{item.key}#{piece}", self._decode(data, item.path))
                piece += 1

    @staticmethod
    def _decode(data: bytes, path: pathlib.Path) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise SourceError(
                f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); known inputs "
                f"are text ({', '.join(TEXT_SUFFIXES)}), JSONL ({', '.join(JSONL_SUFFIXES)}) "
                "and Parquet"
            ) from None

    @staticmethod
    def _open_lines(path: pathlib.Path, raw: io.BufferedReader) -> io.BufferedIOBase:
        name = path.name.lower()
        if name.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw)
        if name.endswith(".zst"):
            import zstandard

            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        return raw

    def _jsonl(self, item: Input) -> Iterator[Document]:
        field = self.text_field
        with open(item.path, "rb") as raw, self._open_lines(item.path, raw) as lines:
            self._current = raw
            for line_no, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{item.path}:{line_no}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    self._skip("not JSON", where)
                    continue
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    self._skip(f"no text field {field!r}", where)
                    continue
                yield Document(f"{item.key}:{line_no}", text)

    def _parquet(self, item: Input) -> Iterator[Document]:
        import pyarrow.parquet as pq

        with open(item.path, "rb") as raw:
            self._current = raw
            try:
                parquet = pq.ParquetFile(raw)
            except Exception as error:  # pyarrow's ArrowInvalid and friends
                raise SourceError(f"{item.path}: not a Parquet file ({error})") from None
            columns = parquet.schema_arrow.names
            if self.text_field not in columns:
                raise SourceError(
                    f"{item.path}: no column {self.text_field!r} (columns: {columns}); name the "
                    "text column with --text_field"
                )
            row = 0
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=[self.text_field])
                for text in table.column(0).to_pylist():
                    if isinstance(text, str):
                        yield Document(f"{item.key}:{row}", text)
                    else:
                        self._skip(
                            f"no text in column {self.text_field!r}", f"{item.path}:row {row}"
                        )
                    row += 1

    def _hf(self, item: Input) -> Iterator[Document]:
        try:
            import datasets
        except ImportError:
            raise SourceError(
                f"{item.path}: a dataset saved with HF datasets.save_to_disk; reading it needs "
                "the `datasets` package (pip install datasets)"
            ) from None
        loaded = datasets.load_from_disk(str(item.path))
        if isinstance(loaded, datasets.DatasetDict):
            if self.split not in loaded:
                raise SourceError(
                    f"{item.path}: no split {self.split!r} (splits: {list(loaded)}); pick one "
                    "with --split"
                )
            loaded = loaded[self.split]
        if self.text_field not in loaded.column_names:
            raise SourceError(
                f"{item.path}: no column {self.text_field!r} (columns: {loaded.column_names}); "
                "name the text column with --text_field"
            )
        row = 0
        for batch in loaded.select_columns([self.text_field]).iter(batch_size=1024):
            for text in batch[self.text_field]:
                if isinstance(text, str):
                    yield Document(f"{item.key}:{row}", text)
                else:
                    self._skip(f"no text in column {self.text_field!r}", f"{item.path}:row {row}")
                row += 1


def input_sizes(inputs: Sequence[Input]) -> list[list]:
    """[key, path, bytes] of each input: what a resumed prepare checks it reads the same files."""
    return [[i.key, os.fspath(i.path), i.size()] for i in inputs]
