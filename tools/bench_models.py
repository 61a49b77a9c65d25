"""Text dense, text MoE and vision dense: dp against decoupled (M=4) at equal tokens.

  python -m tools.bench_models --out=benchmarks/results/models.md

Every run is a real `python -m experiments.train` process (for `decoupled`: a syncer and four
learner processes on 127.0.0.1). All modes see the same examples: dp takes the four learners'
shards as one batch per step, for the same number of steps; synchronous diloco (plain
averaging) runs too, for context. Sizes are small so that the nine runs fit on a shared 2-core
machine:
  * text dense: tiny_lm shrunk to d_model 64, 2 layers, MLP 256, 64-byte windows, batch 8.
  * text MoE: the same with 4 experts of width 128, top-2 (the dense MLP's compute per token).
  * vision dense: tiny_vit (d_model 64, 2 layers, 2x2 patches) on scikit-learn's digits,
    batch 16; evaluation on 352 of the 359 held-out images, with accuracy.
Decoupled (quorum 1, P=4 fragments, RDA, H=50) runs three outer settings from
benchmarks/results/decoupled.md: "lr 1/M" (learner anchor, outer SGD lr 0.25, τ=2), "share"
(partial_merge="share", outer SGD lr 1, τ=2) and "gather + share" (share with τ=10, keep_overlap,
γ=1, grace ≤ 10 s); vision also "share" at H=10. A second table tries, on text dense only, how
close local steps get to dp at all at this size: synchronous DiLoCo and decoupled at H=10 with
several outer optimizers.
A finished run is reused; delete its directory under runs/bench_models to rerun it.

Targets (issue 8): decoupled final eval loss within 2% of dp; on digits, accuracy within
1 point of dp.
"""

from __future__ import annotations

import argparse
import pathlib

from tools.benchkit import ROOT, Section, train
from tools.decoupled_variants import BEFORE_GATHER_DEFAULTS

STEPS = 300
M = 4
TEXT = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.seq_len": 64,
    "data.batch_size": 8,
    "eval.batches": 16,
}
MODELS = {
    "text dense": ("tiny_lm.py", {**TEXT, "model.mlp_hidden": 256}),
    "text MoE": ("tiny_moe.py", {**TEXT, "model.mlp_hidden": 128, "moe.num_experts": 4}),
    "vision dense": ("tiny_vit.py", {"data.batch_size": 16, "eval.batches": 22}),
}
COMMON = {
    "num_learners": M,
    "train_steps": STEPS,
    "inner_steps": 50,
    "eval.every": 0,
    "checkpoint.every": 0,
    "log_every": 100,
}
# Synchronous DiLoCo for context (plain averaging, measured best for diloco in quality.md).
DILOCO = {"outer.lr": 1.0, "outer.momentum": 0.0, "outer.nesterov": False, "outer.merge": "mean"}
DECOUPLED = {  # "lr 1/M"
    # The defaults these runs were measured with (before gather + share became the default).
    **{k: v for k, v in BEFORE_GATHER_DEFAULTS.items() if "stale_anchor" not in k},
    "decoupled.stale_anchor": "learner",
    "outer.lr": 1.0 / M,
    "outer.momentum": 0.0,
    "outer.nesterov": False,
    "decoupled.quorum": 1,
    "decoupled.fragments": 4,
    "decoupled.overlap_steps": 2,
    "outer.merge": "rda",
    "decoupled.partial_merge": "mean",
}
SHARE = {**DECOUPLED, "outer.lr": 1.0, "decoupled.partial_merge": "share"}
GATHER_SHARE = {
    **SHARE,
    "decoupled.overlap_steps": 10,
    "decoupled.keep_overlap": True,
    "decoupled.grace_safety": 1.0,
    "decoupled.syncer.max_grace_s": 10,
}
# (label, run directory suffix, overrides)
VARIANTS = (
    ("lr 1/M", "decoupled", DECOUPLED),
    ("share", "decoupled_share", SHARE),
    ("gather + share", "decoupled_gather_share", GATHER_SHARE),
    ("share (the same command again)", "decoupled_share_repeat", SHARE),
)
# Vision only: the same at H=10 (30 rounds per fragment instead of 6), twice.
VISION_H10 = tuple(
    (f"share, H=10{again}", f"decoupled_share_h10{suffix}", {**SHARE, "inner_steps": 10})
    for again, suffix in (("", ""), (" (the same command again)", "_repeat"))
)
# Text dense only: how close local steps get to dp at this size (label, suffix, overrides).
LOCAL_STEPS = (
    ("diloco, H=50, SGD lr 1", "diloco", {"mode": "diloco", **DILOCO}),
    ("diloco, H=10, SGD lr 1", "diloco_h10_sgd1", {"mode": "diloco", **DILOCO, "inner_steps": 10}),
    (
        "diloco, H=10, SGD lr 2",
        "diloco_h10_sgd2",
        {"mode": "diloco", **DILOCO, "inner_steps": 10, "outer.lr": 2.0},
    ),
    (
        "diloco, H=10, Nesterov 0.7/0.9",
        "diloco_h10_nesterov",
        {
            "mode": "diloco",
            **DILOCO,
            "inner_steps": 10,
            "outer.lr": 0.7,
            "outer.momentum": 0.9,
            "outer.nesterov": True,
        },
    ),
    (
        "decoupled share, H=10, τ=2",
        "decoupled_share_h10",
        {"mode": "decoupled", **SHARE, "inner_steps": 10},
    ),
    (
        "decoupled gather + share, H=10, τ=5",
        "decoupled_gather_share_h10",
        {"mode": "decoupled", **GATHER_SHARE, "inner_steps": 10, "decoupled.overlap_steps": 5},
    ),
)


def run(name: str, config_file: str, args: dict, workroot: pathlib.Path) -> dict:
    """Runs `python -m experiments.train` with `args` (or reuses its finished output)."""
    workdir = workroot / name
    summary = train(workdir, f"experiments/configs/{config_file}", args, tag="bench_models")
    summary["command"] = summary["command"].replace(str(workroot), "runs/bench_models")
    return summary


def _accuracy(summary: dict) -> str:
    acc = summary.get("final_eval_accuracy")
    return "-" if acc is None else f"{100 * acc:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench_models"))
    parser.add_argument("--only", default="", help="comma-separated: dense,moe,vision")
    args = parser.parse_args()
    workroot = pathlib.Path(args.workroot)
    section = Section("models")
    wanted = [x for x in args.only.split(",") if x]
    rows, local_rows, commands = [], [], []
    for label, (config_file, sizes) in MODELS.items():
        if wanted and not any(w.lower() in label.lower() for w in wanted):
            continue
        tag = label.replace(" ", "_").lower()
        dp = run(f"{tag}_dp", config_file, {"mode": "dp", **COMMON, **sizes}, workroot)
        sync = run(
            f"{tag}_diloco", config_file, {"mode": "diloco", **COMMON, **sizes, **DILOCO}, workroot
        )
        commands += [dp["command"], sync["command"]]
        extra = VISION_H10 if label == "vision dense" else ()
        for variant, suffix, overrides in (*VARIANTS, *extra):
            dec = run(
                f"{tag}_{suffix}",
                config_file,
                {"mode": "decoupled", **COMMON, **sizes, **overrides},
                workroot,
            )
            assert dp["tokens"] == dec["tokens"] == sync["tokens"], (dp["tokens"], dec["tokens"])
            commands.append(dec["command"])
            ratio = dec["final_eval_loss"] / dp["final_eval_loss"]
            gap = "-"
            ok = ratio <= 1.02
            section.claim(
                f"{label} decoupled / dp eval loss ({variant})",
                round(ratio, 4),
                unit="×",
                baseline=f"diloco/dp {sync['final_eval_loss'] / dp['final_eval_loss']:.4f}",
                goal="≤ 1.02",
                met=ok,
                section="Models: text dense, text MoE, vision dense; dp vs decoupled (issue 8)",
            )
            if dp.get("final_eval_accuracy") is not None:
                points = 100 * (dp["final_eval_accuracy"] - dec["final_eval_accuracy"])
                gap, ok = f"{points:+.1f} pt", ok and points <= 1.0
            rows.append(
                f"| {label} | {dp['params']:,} | {variant} | {dp['final_eval_loss']:.4f} | "
                f"{dec['final_eval_loss']:.4f} | {ratio:.4f} | {_accuracy(dp)} | "
                f"{_accuracy(dec)} | {gap} | {'yes' if ok else '**no**'} | "
                f"{sync['final_eval_loss'] / dp['final_eval_loss']:.4f} | {_accuracy(sync)} | "
                f"{dp['wall_s']:.0f} / {dec['wall_s']:.0f} / {sync['wall_s']:.0f} |"
            )
        if label != "text dense":
            continue
        for variant, suffix, overrides in LOCAL_STEPS:
            other = run(f"{tag}_{suffix}", config_file, {**COMMON, **sizes, **overrides}, workroot)
            if suffix != "diloco":
                commands.append(other["command"])
            local_rows.append(
                f"| {variant} | {other['final_eval_loss']:.4f} | "
                f"{other['final_eval_loss'] / dp['final_eval_loss']:.4f} |"
            )
    lines = [
        "## Models: text dense, text MoE, vision dense; dp vs decoupled (issue 8)",
        "",
        f"{section.header()} Finished runs are reused. M={M} learners, {STEPS} steps each, "
        "H=50 unless noted; dp runs the same "
        "steps on the four shards as one batch, so every mode trains on the same tokens "
        "(for vision a token is one image). Decoupled: quorum 1, P=4, "
        "RDA (mean for embeddings); outer settings per row (see the module docstring). Targets: "
        "decoupled/dp eval loss ≤ 1.02; digits accuracy at most 1 point below dp. One run each "
        "on a shared 2-core machine: decoupled runs are not repeatable bit for bit (arrival "
        "order varies; about 2.5% run to run on text), and wall times are noisy. Synchronous "
        "DiLoCo (M=4, H=50, plain averaging, outer SGD lr 1) is listed for context: it "
        "separates what local steps cost from what asynchrony costs.",
        "",
        "| model | params | decoupled outer settings | dp eval loss | decoupled eval loss | "
        "ratio | dp accuracy | decoupled accuracy | gap | on target | diloco/dp | diloco "
        "accuracy | wall s (dp / decoupled / diloco) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if local_rows:
        lines += [
            "### Text dense: how close do local steps get to dp at this size?",
            "",
            "The same dp run as above; M=4, 300 steps per learner. Synchronous DiLoCo is the "
            "asynchronous mode's reference: if it cannot come within 2% of dp, the decoupled "
            "mode's target is a property of the size (four learners at batch 8 against one at "
            "batch 32 for 300 AdamW steps), not of asynchrony.",
            "",
            "| run | final eval loss | ratio to dp |",
            "|---|---|---|",
            *local_rows,
            "",
        ]
    lines += ["Commands of each run:", "", *(f"- `{c}`" for c in commands), ""]
    section.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
