r"""`python -m decoupled_diloco.syncer`: one syncer process (or one shard of it).

DD_RUN_TOKEN=secret python -m decoupled_diloco.syncer --port=50051 \
      --config=experiments/configs/tiny_lm.py --config.mode=decoupled
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from decoupled_diloco.runtime import die_with_parent
from decoupled_diloco.syncer import server

config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
flags.DEFINE_string("host", "", "Interface to bind (default: config.decoupled.syncer.host).")
flags.DEFINE_integer("port", -1, "Port (default: config.decoupled.syncer.port; 0: any free).")
flags.DEFINE_string("port_file", "", "Write the bound port here once serving.")
flags.DEFINE_integer("shard", 0, "This shard's index in [0, decoupled.syncer.shards).")
flags.DEFINE_string(
    "checkpoint_dir", "", "Commit the state here and resume from it (empty: in memory)."
)
die_with_parent()
sys.exit(app.run(server.main))
