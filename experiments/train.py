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

from absl import app, flags, logging
from ml_collections import config_flags

from decoupled_diloco import config as config_lib
from decoupled_diloco.runtime import configure_cpu_devices, exit_within, share_accelerators

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")
_HINTS = flags.DEFINE_bool("hints", True, "End with where the report is and what to try next.")


def main(argv: list[str]) -> None:
    """Parses the config, fakes CPU devices if needed, and runs `train_and_evaluate`."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
    try:
        config = config_lib.from_config_dict(_CONFIG.value)
    except config_lib.ConfigError as error:
        raise app.UsageError(str(error)) from None
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
    except config_lib.ConfigError as error:  # e.g. too few devices: a message, not a traceback
        raise app.UsageError(str(error)) from None
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
    app.run(main)
