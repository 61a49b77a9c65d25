r"""Tiny byte-level MoE LM: 4 SwiGLU experts per block, top-2 routing, 2 learners.

  python -m experiments.train --config=experiments/configs/tiny_moe.py --workdir=runs/tiny_moe

The config string picks the mode with its outer settings (default: decoupled):
  --config=experiments/configs/tiny_moe.py:dp        # data-parallel baseline
  --config=experiments/configs/tiny_moe.py:diloco    # synchronous DiLoCo (plain averaging)
  --config=experiments/configs/tiny_moe.py:decoupled # syncer + learner processes
Any field can still be overridden, e.g. --config.moe.top_k=1 --config.num_learners=4.

Each expert is half the dense tiny_lm MLP (256 wide), so top-2 routing costs about the same
compute per token as tiny_lm's dense 512-wide MLP, with twice its MLP parameters. Experts are
sharded over the mesh's model axis (--config.mesh.shape=1,4 puts one expert on each device).
"""

from decoupled_diloco import config as c

# Outer settings per mode, the best measured (benchmarks/results/quality.md, decoupled.md and
# models.md): plain averaging for diloco; for decoupled, outer SGD lr 1 without momentum and
# the RDA merge, with the default decoupled algorithm (quorum 1, learner anchor, gather +
# share: a merge of k of the M learners steps k/M of the way, so the same lr suits any M).
# dp has no outer step.
OUTER = {
    "diloco": c.OuterConfig(lr=1.0, momentum=0.0, nesterov=False, merge="mean"),
    "decoupled": c.OuterConfig(lr=1.0, momentum=0.0, nesterov=False, merge="rda"),
}


def get_config(mode: str = "decoupled"):
    return c.as_config_dict(
        c.ExperimentConfig(
            mode=mode,
            num_learners=2,
            inner_steps=50,
            train_steps=300,
            model=c.ModelConfig(
                kind="moe",
                d_model=128,
                num_layers=2,
                num_heads=4,
                mlp_hidden=256,
                seq_len=128,
            ),
            moe=c.MoEConfig(
                num_experts=4,
                top_k=2,
                capacity_factor=1.25,
                aux_loss_weight=0.01,
                z_loss_weight=0.001,
            ),
            data=c.DataConfig(batch_size=16),
            optim=c.OptimConfig(lr=3e-3),
            outer=OUTER.get(mode, c.OuterConfig()),
            mesh=c.MeshConfig(shape=(1, 1)),
            checkpoint=c.CheckpointConfig(every=0),
            eval=c.EvalConfig(every=50, batches=8),
        )
    )
