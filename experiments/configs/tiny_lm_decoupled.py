r"""Tiny byte-level LM (0.5M params) as 2 decoupled learners and a syncer on 127.0.0.1.

  python -m experiments.train --config=experiments/configs/tiny_lm_decoupled.py \
      --workdir=runs/tiny_lm_decoupled

Heterogeneous learners (a 1-device and a 2-device mesh, the second 3x slower):
  ... --config.decoupled.mesh_shapes=1x1,2x1 --config.slow_learner=1 --config.slowdown=3

The same processes by hand (e.g. on separate hosts; the run token in the environment):
  export DD_RUN_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
  python -m decoupled_diloco.syncer --config=experiments/configs/tiny_lm_decoupled.py \
      --host=0.0.0.0 --port=50051
  python -m decoupled_diloco.learner --config=experiments/configs/tiny_lm_decoupled.py \
      --syncer=SYNCER_HOST:50051 --learner_id=0     # and --learner_id=1 elsewhere
  python -m decoupled_diloco.status --syncer=SYNCER_HOST:50051
"""

from decoupled_diloco import config as c


def get_config():
    return c.as_config_dict(
        c.ExperimentConfig(
            mode="decoupled",
            num_learners=2,
            inner_steps=50,
            train_steps=300,
            model=c.ModelConfig(
                d_model=128, num_layers=2, num_heads=4, mlp_hidden=512, seq_len=128
            ),
            data=c.DataConfig(batch_size=16),
            optim=c.OptimConfig(lr=3e-3),
            # Plain averaging of a gathered round (lr 1, no momentum): measured best on this
            # model (benchmarks/results/decoupled.md); the paper's 0.7/0.9 Nesterov did worse.
            outer=c.OuterConfig(lr=1.0, momentum=0.0, nesterov=False, merge="rda"),
            mesh=c.MeshConfig(shape=(1, 1)),
            checkpoint=c.CheckpointConfig(every=0),
            eval=c.EvalConfig(every=50, batches=8),
            # The decoupled algorithm is the default one, the best measured ("gather +
            # share", see `DecoupledConfig`): 4 fragments, τ = H/5, merges applied on arrival.
        )
    )
