r"""Byte-level LM of 1.03B parameters (20 layers, d_model 2048, 16 heads, SwiGLU 5632), 2 learners.

  python -m experiments.train --config=experiments/configs/lm_1b.py --workdir=runs/lm_1b

Sequence length 1024 (`--config.model.seq_len=...`), bfloat16 compute with float32 parameters
and optimizer state (`--config.model.dtype=float32` for all-float32). Sized for accelerators:
on this repository's 2-core CPU machines it runs, slowly, for benchmarks only
(`python -m tools.bench_scale`, benchmarks/results/scale.md). One island across all local
devices, e.g. 8 GPUs: `--config.mesh.shape=8,1`; the synchronous baselines:
`--config.mode=dp` or `--config.mode=diloco`.
"""

from decoupled_diloco import config as c


def get_config():
    return c.as_config_dict(
        c.ExperimentConfig(
            mode="decoupled",
            num_learners=2,
            inner_steps=100,
            train_steps=2000,
            model=c.ModelConfig(
                d_model=2048,
                num_layers=20,
                num_heads=16,
                mlp_hidden=5632,
                seq_len=1024,
                dtype="bfloat16",
            ),
            data=c.DataConfig(batch_size=8),
            optim=c.OptimConfig(lr=2e-4),
            mesh=c.MeshConfig(shape=(1, 1)),
            checkpoint=c.CheckpointConfig(every=500),
            eval=c.EvalConfig(every=500, batches=4),
        )
    )
