r"""Byte-level LMs at real sizes, 2 decoupled learners: `lm.py:125m` (default), `:350m`, `:1b`.

  python -m experiments.train --config=experiments/configs/lm.py:125m --workdir=runs/lm_125m

| size | parameters | layers | d_model | heads | SwiGLU | inner lr |
|---|---|---|---|---|---|---|
| 125m | 113.5M | 12 | 768 | 12 | 3072 | 3e-4 |
| 350m | 365M | 24 | 1024 | 16 | 3584 | 3e-4 |
| 1b | 1.03B | 20 | 2048 | 16 | 5632 | 2e-4 |

Sequence length 1024 (`--config.model.seq_len=...`), bfloat16 compute with float32 parameters
and optimizer state (`--config.model.dtype=float32` for all-float32). Sized for accelerators:
on this repository's 2-core CPU machines they run, slowly, for benchmarks only
(`python -m tools.bench_scale`, benchmarks/results/scale.md). One island across all local
devices, e.g. 8 GPUs: `--config.mesh.shape=8,1`; the synchronous baselines:
`--config.mode=dp` or `--config.mode=diloco`.
"""

from decoupled_diloco import config as c

# size -> (d_model, num_layers, num_heads, mlp_hidden, inner learning rate)
SIZES = {
    "125m": (768, 12, 12, 3072, 3e-4),
    "350m": (1024, 24, 16, 3584, 3e-4),
    "1b": (2048, 20, 16, 5632, 2e-4),
}


def get_config(size: str = "125m"):
    if size not in SIZES:
        raise ValueError(f"lm.py:{size}: unknown size; choose from {', '.join(SIZES)}")
    d_model, num_layers, num_heads, mlp_hidden, lr = SIZES[size]
    return c.as_config_dict(
        c.ExperimentConfig(
            mode="decoupled",
            num_learners=2,
            inner_steps=100,
            train_steps=2000,
            model=c.ModelConfig(
                d_model=d_model,
                num_layers=num_layers,
                num_heads=num_heads,
                mlp_hidden=mlp_hidden,
                seq_len=1024,
                dtype="bfloat16",
            ),
            data=c.DataConfig(batch_size=8),
            optim=c.OptimConfig(lr=lr),
            mesh=c.MeshConfig(shape=(1, 1)),
            checkpoint=c.CheckpointConfig(every=500),
            eval=c.EvalConfig(every=500, batches=4),
        )
    )
