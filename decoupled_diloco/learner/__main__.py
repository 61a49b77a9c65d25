r"""`python -m decoupled_diloco.learner`: one learner process.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=127.0.0.1:50051 \
      --learner_id=0 --config=experiments/configs/tiny_lm.py --config.mode=decoupled

The flags are defined here, in the module that `python -m` runs, so that `--help` lists them
(absl shows the main module's flags); `cli.start` reads them and runs the learner.
"""

from absl import flags
from ml_collections import config_flags

from decoupled_diloco.learner import cli as learner_cli

config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
flags.DEFINE_string(
    "syncer", "127.0.0.1:50051", "HOST:PORT of the syncer (of each shard: comma-separated)."
)
flags.DEFINE_integer("learner_id", 0, "This learner's index.")
flags.DEFINE_string("mesh_shape", "", "DATAxMODEL, overriding the config (e.g. 2x1).")
flags.DEFINE_float("slowdown", 0.0, "Step slow-down factor (default: from the config).")
flags.DEFINE_string("summary", "", "Write this learner's summary JSON here.")
flags.DEFINE_string(
    "workdir", "", "Run directory: checkpoints and data journal (with checkpoint.every)."
)
flags.DEFINE_string("coordinator", "", "Multi-process island: HOST:PORT of its process 0.")
flags.DEFINE_integer("num_processes", 1, "Processes (hosts) forming this learner's island.")
flags.DEFINE_integer("process_id", 0, "This process's index in its island (0: leader).")
flags.DEFINE_integer(
    "metrics_port",
    -1,
    "Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free; -1: off).",
)
flags.DEFINE_string("metrics_host", "127.0.0.1", "Interface the metrics bind (default: loopback).")
flags.DEFINE_string("metrics_port_file", "", "Write the metrics' bound port here.")
flags.DEFINE_string("standby", "", "Warm standby: warm up, then wait in DIR (see standby).")
learner_cli.start()
