r"""Trains a model as M islands: `python -m experiments.train --config=CONFIG --workdir=DIR`.

Example:
  python -m experiments.train --config=experiments/configs/tiny_lm.py --workdir=runs/tiny \
      --config.mode=dp --config.num_learners=4

`--config.mode=decoupled` starts a syncer and one process per learner on 127.0.0.1 (see
`decoupled_diloco.local.launch` and `experiments/configs/tiny_lm_decoupled.py`).

Kept short on purpose: the logic is `decoupled_diloco.train.train_and_evaluate`, importable
from Colab and research code.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime import configure_cpu_devices, exit_within, share_accelerators

_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")
_HINTS = flags.DEFINE_bool("hints", True, "End with where the report is and what to try next.")
_TRACEBACK = flags.DEFINE_bool(
    "traceback", False, "On a bad config, path or flag: the whole traceback, not one line."
)


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user's config, flags or files can cause: one line and exit code 2, no traceback."""
    from decoupled_diloco.chaos.faults import ChaosError
    from decoupled_diloco.data.packed import DataMismatchError
    from decoupled_diloco.data.sources import SourceError

    return (config_lib.ConfigError, ChaosError, DataMismatchError, SourceError, FileNotFoundError)


def _fail(message: str) -> None:
    """The error on stderr in a line or two, exit code 2 (as absl's usage errors)."""
    print(f"experiments.train: error: {message}", file=sys.stderr)
    print("(--traceback shows where it was raised; --helpfull lists the flags)", file=sys.stderr)
    sys.exit(2)


def _override_error(error: Exception) -> None:
    """An unknown or malformed `--config.X` (ml_collections raises it) as one line."""
    if "--traceback" in sys.argv:
        raise error
    # ml_collections: AttributeError(KeyError("'inner_stepz'\nDid you mean \"inner_steps\"?"))
    while error.args and isinstance(error.args[0], Exception):
        error = error.args[0]
    text = str(error.args[0] if error.args else error).strip().replace("\n", ": ")
    _fail(f"a --config override names no field of the config, or cannot be applied: {text}")


def _config_file_error(error: OSError) -> None:
    """ml_collections could not load the `--config` file: which file, and why, in a line."""
    reason = str(error).strip().splitlines()[-1].strip()
    name = next((a.split("=", 1)[1] for a in reversed(sys.argv) if a.startswith("--config=")), "")
    _fail(f"--config={name}: cannot be loaded: {reason}")


def _parse_flags(argv: list[str]) -> list[str]:
    """Parses the flags; a bad one is a line on stderr, not the flags' help (absl's default)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        _fail(str(error))
    except OSError as error:
        if "--traceback" in argv:
            raise
        _config_file_error(error)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        _override_error(error)
    return []


# ml_collections reads the `--config.X` overrides in sys.argv when the flag is defined.
try:
    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
except (AttributeError, KeyError, TypeError, ValueError) as _error:
    _override_error(_error)


def main(argv: list[str]) -> None:
    """Parses the config, fakes CPU devices if needed, and runs `train_and_evaluate`."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
    try:
        config = config_lib.from_config_dict(_CONFIG.value)
    except (config_lib.ConfigError, OSError) as error:
        if _TRACEBACK.value:
            raise
        if isinstance(error, OSError):
            _config_file_error(error)
        _fail(str(error))
    configure_cpu_devices(config.num_learners * config.devices_per_learner)
    share_accelerators()  # the launcher and its children on one host's GPUs
    from decoupled_diloco.chaos import faults
    from decoupled_diloco.local.supervisor import CHILD_ENV
    from decoupled_diloco.train import train_and_evaluate

    # Run by a fault supervisor (a `dp`/`diloco` run under chaos): the learners' live controls.
    controls = None
    if os.environ.get(CHILD_ENV):
        controls = [faults.Controls.from_env(i) for i in range(config.num_learners)]
    try:
        result = train_and_evaluate(config, _WORKDIR.value, supervised_controls=controls)
    except _user_errors() as error:  # e.g. too few devices, a missing path: a message
        if _TRACEBACK.value:
            raise
        _fail(str(error))
    except (KeyboardInterrupt, SystemExit):  # Ctrl+C, SIGTERM: the children are reaped by now
        exit_within()  # and what is left of the exit is bounded too (`runtime.exit_on_signals`)
        raise
    s = result.summary
    accuracy = s.get("final_eval_accuracy")
    accuracy_text = f", accuracy {100 * accuracy:.1f}%" if accuracy is not None else ""
    print(
        f"[{s['mode']}] done: final eval loss {s['final_eval_loss']:.4f}{accuracy_text} after "
        f"{s['tokens']:,} {s.get('token_unit', 'tokens')} in {s['wall_s']:.0f}s; metrics and "
        f"summary in {_WORKDIR.value}/"
    )
    from decoupled_diloco.obs.report import next_steps, write_report

    report = write_report(_WORKDIR.value)
    if result.monitor is not None:  # `monitor.enabled`: the page was up until the report
        result.monitor.stop()
    if _HINTS.value:
        config_file = config_flags.get_config_filename(flags.FLAGS["config"])
        print(next_steps(config, report, config_file), flush=True)
    else:
        print(f"Report: {report}", flush=True)


if __name__ == "__main__":
    from decoupled_diloco.runtime import die_with_parent

    die_with_parent()  # a no-op unless our own launcher (a chaos supervisor) started this
    app.run(main, flags_parser=_parse_flags)
