r"""A trained model as plain files: weights, config and tokenizer; and back as an nnx model.

    python -m decoupled_diloco.export --workdir=runs/demo --out=runs/demo_model

Every run with a workdir keeps its final global model in `WORKDIR/model/` (for decoupled, the
syncer's global parameters as the evaluator pulled them; the weights as safetensors only);
`export` checks that it loads and writes it where you say, with an Orbax checkpoint of the
same weights beside. The exported directory is readable without this framework:

    model.safetensors   every parameter by its `/`-joined path ("blocks/0/attn/q/kernel")
    params/             the same flat dict as an Orbax checkpoint (exports; StandardCheckpointer)
    config.json         the experiment config (the vocabulary resolved from the data)
    model.json          format and version, the run's mode, steps, parameter count, tokenizer
    tokenizer/          the run's tokenizer file (none for bytes)

`load_model(DIR)` gives back the nnx model (and its tokenizer and config) for evaluation,
sampling (`decoupled_diloco.sample`) or fine-tuning.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from decoupled_diloco import config as config_lib
from decoupled_diloco import tasks
from decoupled_diloco.core.fragments import path_name
from decoupled_diloco.data import shards as shards_lib
from decoupled_diloco.data import tokenizer as tokenizer_lib

FORMAT = "decoupled_diloco/model"
VERSION = 1
MODEL_DIR = "model"  # a run's own copy, under its workdir


class ExportError(ValueError):
    """A directory that is not a run or not a model, or one with a part missing; says which."""


@dataclasses.dataclass
class TrainedModel:
    """A trained model rebuilt from its directory.

    Attributes:
      model: the nnx module, its parameters loaded.
      config: the experiment config it was trained with.
      tokenizer: its tokenizer (`data.tokenizer`), or None (not text).
      info: `model.json`: mode, steps, parameter count, tokenizer facts.
    """

    model: Any
    config: config_lib.ExperimentConfig
    tokenizer: Any
    info: dict[str, Any]
    _decoder: Any = dataclasses.field(default=None, init=False, repr=False)

    def decoder(self) -> Any:
        """The model's `models.decode.Decoder`, made once: its compiled steps are reused."""
        if self._decoder is None:
            from decoupled_diloco.models.decode import Decoder

            self._decoder = Decoder(self.model, context=self.config.model.seq_len)
        return self._decoder


def run_tokenizer(config: config_lib.ExperimentConfig) -> Any:
    """The tokenizer of a built-in text run's data (a prepared directory's, or bytes); else None."""
    if config.task or config.data.dataset != "text":
        return None
    path = pathlib.Path(config.data.path) if config.data.path else None
    if path is None or not shards_lib.is_prepared(path):
        return tokenizer_lib.ByteTokenizer()
    info = shards_lib.read_manifest(path)["tokenizer"]
    return tokenizer_lib.load_saved(path, info["kind"], info["file"], info["eos_id"])


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """Every leaf by its `/`-joined path, as host numpy arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {path_name(path): np.asarray(leaf) for path, leaf in leaves}


def save_model(
    out: pathlib.Path,
    params: Any,
    config: config_lib.ExperimentConfig,
    facts: dict[str, Any],
) -> pathlib.Path:
    """Writes a run's model directory (see the module doc; no Orbax copy) atomically.

    Args:
      out: the directory to write (replaced if it exists).
      params: the global parameters (the task's synced tree).
      config: the run's config.
      facts: what `model.json` adds about the run (mode, steps_done, ...).
    """
    from safetensors.numpy import save_file

    out = pathlib.Path(out).absolute()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = dataclasses.replace(config, model=tasks.model_config(config))
    flat = flat_params(params)
    # (safetensors stores numpy's own dtypes: a bfloat16 leaf is written as float32.)
    plain = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in flat.items()}
    save_file(plain, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
    tokenizer = run_tokenizer(config)
    if tokenizer is not None and tokenizer.kind != "bytes":
        (tmp / "tokenizer").mkdir()
    info = {
        "format": FORMAT,
        "version": VERSION,
        **facts,
        "params": int(sum(v.size for v in flat.values())),
        "tokenizer": None
        if tokenizer is None
        else {
            "kind": tokenizer.kind,
            "file": tokenizer.save(tmp / "tokenizer") if tokenizer.kind != "bytes" else "",
            "eos_id": int(tokenizer.eos_id),
            "digest": tokenizer.digest,
        },
    }
    (tmp / "model.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def model_dir(path: str | pathlib.Path) -> pathlib.Path:
    """The model directory of `path`: a run's workdir (its `model/`) or a model directory.

    Raises:
      ExportError: `path` is neither, or the run ended before it kept its model.
    """
    path = pathlib.Path(path)
    if (path / "model.json").is_file():
        return path
    if (path / MODEL_DIR / "model.json").is_file():
        return path / MODEL_DIR
    if (path / "summary.json").is_file() or (path / "config.py").is_file():
        raise ExportError(
            f"{path} is a run without a saved model ({MODEL_DIR}/ is missing): it did not "
            "finish, or finished before models were kept; train it (again) to the end"
        )
    raise ExportError(
        f"{path} is not a run's workdir (no summary.json) nor a model directory (no "
        "model.json): give the --workdir of a finished run or the --out of an export"
    )


def load_model(path: str | pathlib.Path, import_task: bool = False) -> TrainedModel:
    """The nnx model of a run's workdir or a model directory, its parameters loaded.

    Args:
      path: the run's workdir, or a model directory (`export --out`).
      import_task: allow a model of a user's own task: its `config.task` names a module that
        is imported (its code runs), so only for directories you trust. The built-in models
        need no import.

    Raises:
      ExportError: not a run or a model, another format version, a part missing (the
        tokenizer file, a parameter), or a user's task without `import_task`.
    """
    from flax import nnx
    from safetensors.numpy import load_file

    from decoupled_diloco.models.mesh import make_island_mesh

    directory = model_dir(path)
    info = json.loads((directory / "model.json").read_text())
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise ExportError(
            f"{directory}/model.json: format {info.get('format')!r} version "
            f"{info.get('version')!r}; this release reads {FORMAT!r} version {VERSION}"
        )
    config = config_lib.from_config_dict(json.loads((directory / "config.json").read_text()))
    if config.task and not import_task:
        raise ExportError(
            f"{directory}: a model of the task {config.task!r}, which loading imports (its code "
            "runs): pass import_task=True (--import_task) for a directory you trust"
        )
    tokenizer = _tokenizer(directory, info.get("tokenizer"))
    flat = load_file(str(directory / "model.safetensors"))
    task = tasks.make_task(config)
    with jax.set_mesh(make_island_mesh((1, 1), jax.devices()[:1])):  # the annotations need one
        model = task.build_model(nnx.Rngs(config.seed))
        graphdef, synced, local = task.split_states(model)
        abstract = nnx.to_pure_dict(synced)
        paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        missing = [path_name(p) for p, _ in paths if path_name(p) not in flat]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ExportError(f"{directory}/model.safetensors lacks {missing[:3]}{more}")
        values = [
            np.asarray(flat[path_name(p)]).astype(np.asarray(leaf).dtype) for p, leaf in paths
        ]
        nnx.replace_by_pure_dict(synced, jax.tree_util.tree_unflatten(treedef, values))
        model = nnx.merge(graphdef, synced, local)
    return TrainedModel(model, config, tokenizer, info)


def _tokenizer(directory: pathlib.Path, info: dict[str, Any] | None) -> Any:
    if info is None:
        return None
    if info["kind"] == "bytes":
        return tokenizer_lib.ByteTokenizer()
    path = directory / "tokenizer" / info["file"]
    if not path.is_file():
        raise ExportError(
            f"{directory}: its tokenizer file tokenizer/{info['file']} is missing (the model's "
            f"token ids mean nothing without it: {info['kind']}, digest {info['digest']})"
        )
    return tokenizer_lib.load_saved(directory / "tokenizer", info["kind"], info["file"],
                                    info["eos_id"])  # fmt: skip


def export(
    workdir: str | pathlib.Path, out: str | pathlib.Path, import_task: bool = False
) -> pathlib.Path:
    """A run's model directory at `out` with an Orbax checkpoint added, once it loads.

    `out` is created, or replaced if it holds an earlier export; nothing else is overwritten.

    Raises:
      ExportError: `workdir` is not a finished run, its model does not load, or `out` is
        the run, lies inside it or around it, or is a directory of something else.
    """
    source, out = model_dir(workdir).resolve(), pathlib.Path(out).resolve()
    run = source.parent if source.name == MODEL_DIR else source
    for inside, outside in ((out, run), (run, out)):
        if inside == outside or outside in inside.parents:
            raise ExportError(f"--out={out}: the run's own directory {run}, inside or around it")
    if out.exists() and any(out.iterdir()) and not (out / "model.json").is_file():
        raise ExportError(f"--out={out} exists and holds something other than an export")
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    load_model(source, import_task)  # (a model that does not load is not exported)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("params"))
        checkpointer = ocp.StandardCheckpointer()  # the same flat dict, for Orbax users
        checkpointer.save(tmp / "params", load_file(str(source / "model.safetensors")))
        checkpointer.wait_until_finished()
        checkpointer.close()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: Sequence[str]) -> None:
    """`python -m decoupled_diloco.export --workdir=RUN --out=DIR`."""
    from absl import flags

    del argv
    try:
        out = export(flags.FLAGS.workdir, flags.FLAGS.out, flags.FLAGS.import_task)
    except ExportError as error:
        sys.exit(f"export: {error}")
    info = json.loads((out / "model.json").read_text())
    print(
        f"[export] {info['params']:,} parameters of a {info.get('mode')} run "
        f"({info.get('steps_done')} steps) in {out}: model.safetensors, params/ (Orbax), "
        "config.json, model.json" + (", tokenizer/" if (out / "tokenizer").exists() else ""),
        flush=True,
    )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", None, "A finished run's workdir (or a model directory).")
    flags.DEFINE_string("out", None, "Where to write the model directory.")
    flags.DEFINE_bool("import_task", False, "Allow a user's task (its module is imported).")
    flags.mark_flags_as_required(["workdir", "out"])
    app.run(main)
