"""Tokenizers: bytes, any HF `tokenizer.json`, a SentencePiece `.model`, or a BPE trained here.

Every tokenizer has the same small surface: `encode_batch(texts)` (one int array per text, no
special tokens added), `decode(ids)`, `vocab_size`, `eos_id` (the end-of-document token that
packing appends) and `digest` (what identifies it in manifests, checkpoints and summaries).

    tokenizer = load_tokenizer("bytes")                   # ids 0..255, end of document 256
    tokenizer = load_tokenizer("path/to/tokenizer.json")  # HF tokenizers
    tokenizer = load_tokenizer("path/to/spm.model")       # SentencePiece
    tokenizer = train_bpe(texts, vocab_size=8192)         # byte-level BPE on your own text

The digest of a file-backed tokenizer is its kind and the SHA-256 of the file's bytes, so the same
file gives the same digest on every machine, and any edit gives another.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

# End-of-document tokens looked for, in this order, in a tokenizer that names none.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BPE_EOS = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file or the setting."""


class Tokenizer(Protocol):
    """What the prepare step, the loader and sampling need of a tokenizer."""

    kind: str  # "bytes", "hf" or "sentencepiece"
    file: str  # its file's name in a prepared directory ("" for bytes)
    vocab_size: int
    eos_id: int
    digest: str

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added)."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""

    def save(self, directory: pathlib.Path) -> str:
        """Writes the tokenizer's file into `directory`; returns its name ("" for bytes)."""


def _file_digest(kind: str, path: pathlib.Path) -> str:
    return f"{kind}:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; the end of a document is 256 (vocabulary 257)."""

    kind = "bytes"
    vocab_size = 257
    eos_id = 256
    digest = "bytes:v1"
    file = ""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's UTF-8 bytes."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes below 256 as UTF-8 (invalid sequences replaced)."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory: pathlib.Path) -> str:
        """Nothing to write."""
        del directory
        return ""


class HFTokenizer:
    """A HF `tokenizers` tokenizer read from its `tokenizer.json`."""

    kind = "hf"
    file = "tokenizer.json"

    def __init__(self, path: str | os.PathLike, eos_token: str = ""):
        import tokenizers

        self.path = pathlib.Path(path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # the library raises a bare Exception on a bad file
            raise TokenizerError(
                f"tokenizer {self.path}: not a HF tokenizer.json ({error})"
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = _eos_id(self.path, eos_token, self._tokenizer.token_to_id)
        self.digest = _file_digest(self.kind, self.path)
        self._encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode_batch` (all cores; the GIL released), without added special tokens."""
        encodings = self._encode(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """`Tokenizer.decode`, special tokens skipped."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: pathlib.Path) -> str:
        """Copies the `tokenizer.json`."""
        return _copy(self.path, directory / self.file)


class SentencePieceTokenizer:
    """A SentencePiece model read from its `.model` file."""

    kind = "sentencepiece"
    file = "tokenizer.model"

    def __init__(self, path: str | os.PathLike, eos_token: str = ""):
        import sentencepiece

        self.path = pathlib.Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(
                f"tokenizer {self.path}: not a SentencePiece model ({error})"
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        if eos_token:
            self.eos_id = _eos_id(self.path, eos_token, self._piece_id)
        elif self._sp.eos_id() >= 0:
            self.eos_id = self._sp.eos_id()
        else:
            raise TokenizerError(
                f"tokenizer {self.path}: the SentencePiece model has no end-of-sentence piece; "
                "name one with --eos_token"
            )
        self.digest = _file_digest(self.kind, self.path)
        self._threads = os.cpu_count() or 1

    def _piece_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        return None if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i) else i

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` over the batch on every core."""
        ids = self._sp.encode(list(texts), num_threads=self._threads)
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """`decode` of the ids."""
        return self._sp.decode([int(i) for i in ids])

    def save(self, directory: pathlib.Path) -> str:
        """Copies the `.model`."""
        return _copy(self.path, directory / self.file)


def _copy(source: pathlib.Path, target: pathlib.Path) -> str:
    if not target.exists() or not os.path.samefile(source, target):
        shutil.copyfile(source, target)
    return target.name


def _eos_id(path: pathlib.Path, eos_token: str, token_to_id) -> int:
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    for name in names:
        token_id = token_to_id(name)
        if token_id is not None:
            return int(token_id)
    if eos_token:
        raise TokenizerError(
            f"tokenizer {path}: --eos_token {eos_token!r} is not in its vocabulary"
        )
    raise TokenizerError(
        f"tokenizer {path}: none of {list(EOS_CANDIDATES)} is in its vocabulary; name its "
        "end-of-document token with --eos_token"
    )


def load_tokenizer(spec: str, eos_token: str = "") -> Tokenizer:
    """The tokenizer `spec` names: "bytes", a `tokenizer.json` or a SentencePiece `.model`.

    Args:
      spec: "bytes", or the path of a HF `tokenizer.json` (any `.json`) or of a SentencePiece
        model (`.model`). (A BPE to train is `train_bpe`'s.)
      eos_token: the end-of-document token's text; empty: the tokenizer's own (SentencePiece's
        eos piece; else the first of `EOS_CANDIDATES` in its vocabulary).

    Raises:
      TokenizerError: the file is missing or of an unknown kind, or has no end-of-document token.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec)
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {spec!r}: no such file (expected 'bytes', 'bpe:VOCAB', a tokenizer.json "
            "or a SentencePiece .model)"
        )
    if path.suffix == ".json":
        return HFTokenizer(path, eos_token)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, eos_token)
    raise TokenizerError(
        f"tokenizer {spec!r}: unknown kind of file {path.suffix!r} (expected a HF tokenizer.json "
        "or a SentencePiece .model)"
    )


def load_saved(directory: pathlib.Path, kind: str, file: str, eos_id: int) -> Tokenizer:
    """The tokenizer a prepared directory holds (its manifest's `kind` and `file`)."""
    if kind == "bytes":
        return ByteTokenizer()
    tokenizer = (HFTokenizer if kind == "hf" else SentencePieceTokenizer)(directory / file)
    tokenizer.eos_id = eos_id  # as prepared (it may have been named with --eos_token)
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int, path: pathlib.Path) -> HFTokenizer:
    """Trains a byte-level BPE (GPT-2's scheme) of `vocab_size` on `texts`; saves it at `path`.

    Its end-of-document token is `<|endoftext|>`; any text round-trips through it exactly.

    Raises:
      TokenizerError: `vocab_size` is too small for the byte alphabet and the special token.
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(
            f"bpe:{vocab_size}: a byte-level BPE needs a vocabulary of at least "
            f"{len(alphabet) + 1} (256 bytes and the end-of-document token)"
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return HFTokenizer(path, BPE_EOS)
