r"""Muon against AdamW as the inner optimizer of the built-in LM, in `diloco` mode, equal tokens.

  python -m tools.bench_muon --out=benchmarks/results/muon.md

`experiments/configs/tiny_lm.py` (0.5M parameters, M = 2 islands, H = 50, 300 steps each, the
same data and token budget for every row); AdamW at its configured learning rate against Muon
(`--config.optim.name=muon`, `optax.contrib.muon`) at a few learning rates, with AdamW at
3e-3 for the tensors Muon does not take (vectors, embedding tables). Reports the final
held-out loss of the global model.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from decoupled_diloco.runtime import configure_cpu_devices  # noqa: E402

configure_cpu_devices(2)

import decoupled_diloco as dd  # noqa: E402
from decoupled_diloco import config as config_lib  # noqa: E402
from tools.benchkit import RESULTS, ROOT, Section  # noqa: E402

RUNS = [  # (label, optim overrides)
    ("AdamW, lr 3e-3 (the config's)", {}),
    ("Muon, lr 0.01", {"optim.name": "muon", "optim.lr": 0.01, "optim.adam_lr": 3e-3}),
    ("Muon, lr 0.02", {"optim.name": "muon", "optim.lr": 0.02, "optim.adam_lr": 3e-3}),
    ("Muon, lr 0.05", {"optim.name": "muon", "optim.lr": 0.05, "optim.adam_lr": 3e-3}),
    ("Muon, lr 0.1", {"optim.name": "muon", "optim.lr": 0.1, "optim.adam_lr": 3e-3}),
]


def _base() -> config_lib.ExperimentConfig:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tiny_lm", ROOT / "experiments/configs/tiny_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = config_lib.from_config_dict(module.get_config())
    return config_lib.replace(config, **{"checkpoint.every": 0, "eval.every": 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(RESULTS / "muon.md"))
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    base = config_lib.replace(_base(), train_steps=args.steps)
    rows = []
    for label, overrides in RUNS:
        config = config_lib.replace(base, **overrides)
        with tempfile.TemporaryDirectory() as workdir:
            s = dd.train_and_evaluate(config, workdir).summary
        rows.append((label, s["final_eval_loss"], s["final_train_loss"], s["tokens"], s["wall_s"]))
        print(f"[bench_muon] {label}: eval {s['final_eval_loss']:.4f}", flush=True)
    best_adam = rows[0][1]
    best = min(rows[1:], key=lambda r: r[1])
    section = Section("muon")
    section.claim(
        f"best Muon ({best[0]}) / AdamW final eval loss",
        round(best[1] / best_adam, 3),
        unit="×",
        baseline=f"{rows[0][0]} {best_adam:.4f}",
        section="Muon as the inner optimizer (diloco, equal tokens)",
        note="one seed per row",
    )
    lines = [
        "## Muon as the inner optimizer (diloco, equal tokens)\n",
        f"{section.header()} `experiments/configs/tiny_lm.py`: the built-in "
        f"byte LM (0.5M parameters), `diloco` with M = 2 islands, H = 50, {args.steps} steps "
        "each, outer SGD lr 1 without momentum (the config's); every row trains on the same "
        "tokens. Muon (`optax.contrib.muon`) takes the 2-D weights, AdamW (lr 3e-3) the vectors "
        "and the embedding table; both on the config's warmup + cosine schedule.\n",
        "| inner optimizer | final eval loss | vs AdamW | final train loss | tokens | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for label, eval_loss, train_loss, tokens, wall in rows:
        lines.append(
            f"| {label} | {eval_loss:.4f} | {eval_loss / best_adam:.3f}x | {train_loss:.4f} | "
            f"{tokens:,} | {wall:.0f} |"
        )
    verdict = "below" if best[1] < best_adam else "above"
    lines.append(
        f"\nBest Muon run ({best[0]}) ends {verdict} AdamW: {best[1]:.4f} against "
        f"{best_adam:.4f} nats/byte. One seed per row.\n"
    )
    section.write(args.out, "\n".join(lines))
    os._exit(0)  # noqa: SLF001 - leave without waiting on JAX's threads


if __name__ == "__main__":
    main()
