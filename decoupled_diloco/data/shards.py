"""The on-disk format of a prepared corpus: token shards, document indexes and a manifest.

A prepared directory holds (see docs/data.md):

    manifest.json            format, version, tokenizer, dtype, every shard with its counts and
                             SHA-256, what was skipped; written last: a directory without it is
                             unfinished
    tokenizer.json|.model    the tokenizer's own file (none for bytes)
    train-00000.npy          one split's tokens, a flat uint16 (vocabulary <= 65,536) or uint32
    train-00000.idx.npy      uint64 offsets of its documents' first tokens, and its length last
    val-00000.npy, ...       the validation documents, held out by a hash of their key

Every `.npy` opens with numpy alone (`np.load(path, mmap_mode="r")`). A document is its tokens
followed by the tokenizer's end-of-document token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import numpy as np

FORMAT = "decoupled_diloco.tokens"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class PreparedDataError(ValueError):
    """A prepared directory that cannot be trained on; the message names the file and why."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path: pathlib.Path) -> str:
    """SHA-256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _save_npy(path: pathlib.Path, array: np.ndarray) -> None:
    """Writes `array` to `path` atomically (a temporary file renamed once complete)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SplitWriter:
    """Gathers one split's documents and writes them as numbered shards.

    Args:
      directory: the prepared directory.
      split: "train" or "val".
      dtype: the token dtype (`token_dtype`).
      eos_id: appended after every document.
    """

    def __init__(self, directory: pathlib.Path, split: str, dtype: np.dtype, eos_id: int):
        self.directory, self.split, self.dtype, self.eos_id = directory, split, dtype, eos_id
        self._parts: list[np.ndarray] = []
        self.tokens = 0
        self.text_bytes = 0

    def add(self, ids: np.ndarray, text_bytes: int) -> None:
        """One document's token ids (its end-of-document token is added here)."""
        self._parts.append(
            np.append(ids.astype(self.dtype, copy=False), self.dtype.type(self.eos_id))
        )
        self.tokens += len(ids) + 1
        self.text_bytes += text_bytes

    def flush(self, number: int) -> dict[str, Any] | None:
        """Writes the gathered documents as shard `number`; its manifest entry (None: empty)."""
        if not self._parts:
            return None
        name = f"{self.split}-{number:05d}"
        lengths = np.fromiter(
            (len(p) for p in self._parts), dtype=np.uint64, count=len(self._parts)
        )
        offsets = np.concatenate([np.zeros(1, np.uint64), np.cumsum(lengths, dtype=np.uint64)])
        tokens = np.concatenate(self._parts)
        _save_npy(self.directory / f"{name}.npy", tokens)
        _save_npy(self.directory / f"{name}.idx.npy", offsets)
        entry = {
            "name": name,
            "split": self.split,
            "documents": len(self._parts),
            "tokens": int(len(tokens)),
            "bytes": self.text_bytes,
            "sha256": file_sha256(self.directory / f"{name}.npy"),
            "index_sha256": file_sha256(self.directory / f"{name}.idx.npy"),
        }
        self._parts, self.tokens, self.text_bytes = [], 0, 0
        return entry


def write_manifest(directory: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Writes `manifest.json` atomically (the directory is complete from then on)."""
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, directory / MANIFEST)


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` is a prepared directory (it holds a manifest)."""
    return bool(path) and (pathlib.Path(path) / MANIFEST).is_file()


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard opened: its tokens and document offsets, memory-mapped."""

    name: str
    tokens_N: np.ndarray
    offsets_D1: np.ndarray
    path: pathlib.Path


def read_manifest(directory: pathlib.Path) -> dict[str, Any]:
    """The manifest of a prepared directory, its format and version checked.

    Raises:
      PreparedDataError: no manifest (an unfinished prepare), or another format or version.
    """
    path = directory / MANIFEST
    if not path.is_file():
        raise PreparedDataError(
            f"{directory}: no {MANIFEST}; not a prepared directory, or its prepare did not finish "
            "(run `python -m decoupled_diloco.data.prepare` again with the same flags to resume)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PreparedDataError(f"{path}: not JSON ({error})") from None
    if manifest.get("format") != FORMAT:
        raise PreparedDataError(f"{path}: format {manifest.get('format')!r}, not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise PreparedDataError(
            f"{path}: format version {manifest.get('version')!r}; this decoupled_diloco reads "
            f"version {VERSION} (prepare the corpus again, or use the release that wrote it)"
        )
    return manifest


def open_shards(
    directory: pathlib.Path, manifest: dict[str, Any], split: str, verify: bool = True
) -> list[Shard]:
    """The split's shards, memory-mapped, each checked against the manifest.

    Args:
      directory: the prepared directory.
      manifest: its `read_manifest`.
      split: "train" or "val".
      verify: also check every file's SHA-256 (reads each once; sizes are always checked).

    Raises:
      PreparedDataError: a shard missing, truncated (its length is not the manifest's),
        of another dtype, or (with `verify`) whose bytes are not what was written.
    """
    dtype = np.dtype(manifest["dtype"])
    shards = []
    for entry in manifest["shards"]:
        if entry["split"] != split:
            continue
        token_path = directory / f"{entry['name']}.npy"
        index_path = directory / f"{entry['name']}.idx.npy"
        for path in (token_path, index_path):
            if not path.is_file():
                raise PreparedDataError(f"{path}: missing (the manifest lists it)")
        try:
            tokens = np.load(token_path, mmap_mode="r")
            offsets = np.load(index_path, mmap_mode="r")
        except ValueError as error:  # numpy: the file is shorter than its header says
            raise PreparedDataError(f"{token_path}: truncated or not a .npy ({error})") from None
        if tokens.shape != (entry["tokens"],) or tokens.dtype != dtype:
            raise PreparedDataError(
                f"{token_path}: {tokens.shape[0] if tokens.ndim else 0} {tokens.dtype} tokens, "
                f"the manifest says {entry['tokens']} {dtype} (truncated or replaced)"
            )
        if offsets.shape != (entry["documents"] + 1,):
            raise PreparedDataError(
                f"{index_path}: {offsets.shape} offsets, the manifest says {entry['documents'] + 1}"
            )
        if verify:
            for path, key in ((token_path, "sha256"), (index_path, "index_sha256")):
                if file_sha256(path) != entry[key]:
                    raise PreparedDataError(
                        f"{path}: its SHA-256 is not the manifest's (the file is corrupted)"
                    )
        shards.append(Shard(entry["name"], tokens, offsets, token_path))
    return shards
