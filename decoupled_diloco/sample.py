r"""Text from a trained model, with the run's own tokenizer.

    python -m decoupled_diloco.sample --workdir=runs/demo --prompt="def " --max_new_tokens=200

From the final model of a run of any mode (`WORKDIR/model/`; for decoupled, the syncer's global
model) or from an exported directory (`python -m decoupled_diloco.export`). In Python:

    trained = dd.load_model("runs/demo")
    text = dd.generate(trained, "def ", max_new_tokens=200, temperature=0.8, top_k=40)

Decoding uses a KV cache and one compiled step for every new token (`models.decode`); a batch
of prompts decodes together. A continuation stops at the tokenizer's end-of-document token.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from decoupled_diloco.export import ExportError, TrainedModel, load_model
from decoupled_diloco.models.decode import GenerationError


def generate(
    trained: TrainedModel | str | pathlib.Path,
    prompts: str | Sequence[str],
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> str | list[str]:
    """The continuation of each prompt (a string for a string, a list for a list).

    Args:
      trained: `load_model(...)`'s result, or the directory to load it from.
      prompts: one prompt or several (decoded as one batch).
      max_new_tokens: tokens to generate after each prompt.
      temperature: 0 for greedy decoding; else the softmax temperature.
      top_k: draw from the `top_k` likeliest tokens only (0: all).
      seed: the draws' seed.

    Raises:
      GenerationError: a prompt longer than the model's context, a bad setting, or a model
        without a tokenizer (not text) or without a decode step.
      ExportError: a directory that is not a run or a model.
    """
    if not isinstance(trained, TrainedModel):
        trained = load_model(trained)
    if trained.tokenizer is None:
        raise GenerationError("this model was not trained on text (it has no tokenizer)")
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [ids.tolist() for ids in trained.tokenizer.encode_batch(texts)]
    new = trained.decoder().generate(ids, max_new_tokens, temperature, top_k, seed)
    eos = trained.tokenizer.eos_id
    out = [trained.tokenizer.decode(_until(row, eos)) for row in new]
    return out[0] if isinstance(prompts, str) else out


def _until(ids: list[int], eos: int) -> list[int]:
    """`ids` up to (without) the first end-of-document token."""
    stops = np.flatnonzero(np.asarray(ids) == eos)
    return ids[: stops[0]] if stops.size else ids


def main(argv: Sequence[str]) -> None:
    """`python -m decoupled_diloco.sample`: prints each prompt with its continuation."""
    from absl import flags

    del argv
    f = flags.FLAGS
    try:
        trained = load_model(f.workdir, f.import_task)
        texts = generate(trained, list(f.prompt), f.max_new_tokens, f.temperature, f.top_k, f.seed)
    except (ExportError, GenerationError) as error:
        sys.exit(f"sample: {error}")
    for prompt, text in zip(f.prompt, texts, strict=True):
        print(f"{prompt}{text}", flush=True)
        print("-" * 40, flush=True)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", None, "A finished run's workdir, or an exported model.")
    flags.DEFINE_multi_string("prompt", None, "A prompt (repeat for a batch of prompts).")
    flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate after each prompt.")
    flags.DEFINE_float("temperature", 1.0, "0: greedy; else the softmax temperature (>= 0).")
    flags.DEFINE_integer("top_k", 0, "Draw from the k likeliest tokens only (0: all).")
    flags.DEFINE_integer("seed", 0, "The draws' seed.")
    flags.DEFINE_bool("import_task", False, "Allow a user's task (its module is imported).")
    flags.mark_flags_as_required(["workdir", "prompt"])
    app.run(main)
