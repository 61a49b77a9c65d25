"""Real data: prepare against the bare tokenizer, the loader, the data wait, a learner's memory.

The data wait is that of `lm_125m`'s step; the memory a learner's on 10 GB against 10 MB.

  python -m tools.bench_data --out=benchmarks/results/data.md [--jsonl_gb=1 --big_gb=10]

Everything it reads is generated here (under --workdir, deleted at the end unless --keep):
  * a JSONL of `--jsonl_gb` GB: documents cut from the Python standard library's source, each
    with its words shuffled by a seeded generator (so no two documents repeat), prepared with a
    byte-level BPE of 8,192 tokens trained on its first 32 MB (`bpe:8192`);
  * the bare tokenizer: the same `tokenizer.json`'s `encode_batch_fast` (what prepare calls),
    in this process, over the same documents in the same ~4 MB batches, only the calls timed;
  * the loader: `PreparedDataset.train_iterator` at sequence 1024, batch 32, one learner;
  * the data wait: `lm_125m` (float32 on CPU with remat, batch 2, sequence 1024) on the corpus,
    the time `next(iterator)` takes beside the time of the compiled step;
  * memory: the same `tiny_lm` dp learner (`experiments.train`, 200 steps, batch 8, sequence
    1024) on a prepared corpus of 10 MB and of `--big_gb` GB (the JSONL's tokens repeated into
    shards), its peak RSS (the process's own VmHWM).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from decoupled_diloco.data import packed, prepare, shards  # noqa: E402
from decoupled_diloco.data import tokenizer as tokenizer_lib  # noqa: E402
from decoupled_diloco.data.text import default_corpus_root  # noqa: E402
from tools.benchkit import ROOT, Section  # noqa: E402

# lm_125m's batch for the data wait: 8 x 1024 in float32 is more than this host's 24 GB.
DATA_WAIT_BATCH = 2


def _write_jsonl(path: pathlib.Path, gigabytes: float) -> int:
    """Documents of shuffled stdlib words until `gigabytes` of JSONL; their count."""
    files = sorted(default_corpus_root().glob("**/*.py"))[:400]
    words = [f.read_text(errors="replace").split() for f in files]
    rng = random.Random(0)
    target, written, count = int(gigabytes * 1e9), 0, 0
    with open(path, "w") as f:
        while written < target:
            source = words[count % len(words)]
            take = rng.randint(200, 2000)
            start = rng.randrange(max(len(source) - take, 1))
            doc = source[start : start + take]
            rng.shuffle(doc)
            line = json.dumps({"text": " ".join(doc)}) + "\n"
            f.write(line)
            written += len(line)
            count += 1
    return count


def _bare_encode_s(jsonl: pathlib.Path, tok: tokenizer_lib.HFTokenizer) -> tuple[float, int, int]:
    """Seconds in `encode_batch_fast` over the JSONL's texts in prepare's batches; tokens; bytes."""
    seconds, tokens, size, batch, batch_bytes = 0.0, 0, 0, [], 0
    encode = tok._tokenizer.encode_batch_fast

    def run(batch):
        start = time.perf_counter()
        out = encode(batch, add_special_tokens=False)
        return time.perf_counter() - start, sum(len(e.ids) for e in out)

    with open(jsonl) as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            batch_bytes += len(text)
            size += len(text.encode())
            if batch_bytes >= prepare.BATCH_BYTES:
                s, n = run(batch)
                seconds, tokens, batch, batch_bytes = seconds + s, tokens + n, [], 0
    if batch:
        s, n = run(batch)
        seconds, tokens = seconds + s, tokens + n
    return seconds, tokens, size


def _loader_rate(directory: pathlib.Path, batches: int = 400) -> float:
    data = packed.PreparedDataset(directory, seq_len=1024, verify=False)
    it = data.train_iterator(32, 0, 1, seed=0)
    for _ in range(20):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * 32 * 1024 / (time.perf_counter() - start)


def _data_wait(directory: pathlib.Path, steps: int) -> tuple[float, float]:
    """(mean s of next(iterator), mean s of the compiled step) for lm_125m on CPU."""
    import jax

    from decoupled_diloco import config as config_lib
    from decoupled_diloco.island import Island
    from tools.device_check import _config

    config = config_lib.replace(
        _config("125m", DATA_WAIT_BATCH, 1024),
        num_learners=1,
        # float32 (bfloat16 is emulated on CPU), remat: activation memory of one block.
        **{
            "model.dtype": "float32",
            "model.remat": True,
            "data.path": str(directory),
            "model.vocab_size": 0,
        },
    )
    island = Island(config, jax.devices()[:1])
    data = packed.PreparedDataset(directory, seq_len=1024, verify=False)
    it = data.train_iterator(DATA_WAIT_BATCH, 0, 1, seed=0)
    state = island.init(0)
    next(it)  # the reader thread started
    state, loss = island.step(state, next(it))  # compiles
    jax.block_until_ready(loss)
    waits, steps_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        state, loss = island.step(state, batch)
        jax.block_until_ready(loss)
        waits.append(t1 - t0)
        steps_s.append(time.perf_counter() - t1)
    return float(np.mean(waits)), float(np.mean(steps_s))


def _repeat_corpus(source: pathlib.Path, target: pathlib.Path, gigabytes: float) -> None:
    """A prepared directory of ~`gigabytes` of tokens: the source's train tokens repeated."""
    manifest = shards.read_manifest(source)
    tokens = np.concatenate(
        [np.load(source / f"{e['name']}.npy") for e in manifest["shards"] if e["split"] == "train"]
    )
    dtype = tokens.dtype
    target.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json",):
        shutil.copyfile(source / f, target / f)
    entries, per_shard = [], 1 << 28  # 512 MB of uint16 per shard
    total = int(gigabytes * 1e9) // dtype.itemsize
    doc = 4096
    for number in range(-(-total // per_shard)):
        writer = shards.SplitWriter(target, "train", dtype, manifest["tokenizer"]["eos_id"])
        count = min(per_shard, total - number * per_shard)
        offset = (number * per_shard) % max(len(tokens) - doc, 1)
        for start in range(0, count, doc):
            i = (offset + start) % (len(tokens) - doc)
            writer.add(tokens[i : i + doc - 1], doc)
        entries.append(writer.flush(number))
    entries += [e for e in manifest["shards"] if e["split"] == "val"]
    for e in manifest["shards"]:
        if e["split"] == "val":
            for suffix in (".npy", ".idx.npy"):
                shutil.copyfile(source / f"{e['name']}{suffix}", target / f"{e['name']}{suffix}")
    totals = dict(manifest["totals"])
    totals["train"] = {
        k: sum(e[k] for e in entries if e["split"] == "train")
        for k in ("documents", "tokens", "bytes")
    }
    shards.write_manifest(target, {**manifest, "shards": entries, "totals": totals})


def _learner_rss(directory: pathlib.Path, workdir: pathlib.Path, steps: int) -> dict[str, float]:
    """Peak RSS (MB) of one dp tiny_lm learner process training on `directory`."""
    # The child reports its own VmHWM: ru_maxrss from wait4 would include this process's
    # memory at the fork (Linux carries it across exec).
    report = (
        "import atexit, runpy, sys; atexit.register(lambda: print('VMHWM_KB', "
        "open('/proc/self/status').read().split('VmHWM:')[1].split()[0], flush=True)); "
        "sys.argv = ['experiments.train', *sys.argv[1:]]; "
        "runpy.run_module('experiments.train', run_name='__main__')"
    )
    cmd = [
        sys.executable, "-c", report, "--config=experiments/configs/tiny_lm.py",
        f"--workdir={workdir}", "--config.mode=dp", "--config.num_learners=1",
        f"--config.data.path={directory}", f"--config.train_steps={steps}",
        "--config.data.batch_size=8", "--config.model.seq_len=1024", "--config.eval.every=0",
        "--config.eval.batches=1", "--config.checkpoint.every=0", "--config.log_every=100",
    ]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"learner failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peak_kb = int(done.stdout.rsplit("VMHWM_KB", 1)[1].split()[0])
    return {"peak_mb": peak_kb / 1024, "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/data.md")
    parser.add_argument("--workdir", default="/tmp/dd_bench_data")
    parser.add_argument("--jsonl_gb", type=float, default=1.0)
    parser.add_argument("--big_gb", type=float, default=10.0)
    parser.add_argument("--rss_steps", type=int, default=200)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = pathlib.Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cores = os.cpu_count() or 1
    jsonl = work / "corpus.jsonl"
    documents = _write_jsonl(jsonl, args.jsonl_gb)
    mb = jsonl.stat().st_size / 1e6
    print(f"[data] {jsonl}: {documents:,} documents, {mb:,.0f} MB", flush=True)
    bpe_dir = work / "bpe"
    tok = tokenizer_lib.train_bpe(
        (json.loads(line)["text"] for line, _ in zip(open(jsonl), range(20_000), strict=False)),
        8192,
        bpe_dir / "tokenizer.json",
    )
    bare_s, bare_tokens, text_bytes = _bare_encode_s(jsonl, tok)
    print(f"[data] bare encode_batch_fast: {bare_s:.1f} s, {bare_tokens:,} tokens", flush=True)
    start = time.perf_counter()
    manifest = prepare.prepare([str(jsonl)], work / "prepared", str(bpe_dir / "tokenizer.json"))
    prep_s = time.perf_counter() - start
    tokens = sum(t["tokens"] for t in manifest["totals"].values())
    loader = _loader_rate(work / "prepared")
    print(f"[data] loader: {loader / 1e6:.2f}M tokens/s", flush=True)
    wait_s, step_s = _data_wait(work / "prepared", steps=3)
    small = work / "small"
    _repeat_corpus(work / "prepared", small, 0.01)
    big = work / "big"
    t0 = time.perf_counter()
    _repeat_corpus(work / "prepared", big, args.big_gb)
    big_write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    packed.PreparedDataset(big, seq_len=1024, verify=True)
    verify_s = time.perf_counter() - t0
    big_bytes = sum(p.stat().st_size for p in big.glob("train-*.npy") if "idx" not in p.name)
    rss_small = _learner_rss(small, work / "run_small", args.rss_steps)
    rss_big = _learner_rss(big, work / "run_big", args.rss_steps)
    print(f"[data] rss {rss_small} vs {rss_big}", flush=True)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    growth = rss_big["peak_mb"] / rss_small["peak_mb"]
    mb_s = text_bytes / 1e6 / prep_s
    bare_mb_s = text_bytes / 1e6 / bare_s
    section = Section("data")
    wait_share = wait_s / (wait_s + step_s)
    title = "Real data: prepare, loader, data wait, memory (real-data issue)"
    for figure, value, unit, goal, met, headline in (
        ("loader rate, seq 1024, batch 32, one learner", round(loader / 1e6, 2), "M tokens/s",
         ">= 5M per host", loader >= 5e6, True),
        ("prepare / bare tokenizer throughput", round(bare_s / prep_s, 3), "×", ">= 0.8",
         bare_s / prep_s >= 0.8, False),
        ("data wait of lm_125m, share of the step", round(100 * wait_share, 3), "%", "<= 1%",
         wait_share <= 0.01, False),
        (f"peak RSS, {big_bytes / 1e9:.1f} GB corpus vs 10 MB corpus", round(100 * (growth - 1), 1),
         "%", "within 5%", abs(growth - 1) <= 0.05, False),
    ):  # fmt: skip
        section.claim(
            figure, value, unit=unit, goal=goal, met=met, headline=headline, section=title
        )
    lines = [
        "## Real data: prepare, loader, data wait, memory (real-data issue)",
        "",
        f"{section.header()} "
        "Corpus and tokenizer generated by the benchmark (see `tools/bench_data.py`).",
        "",
        f"**Prepare** ({mb:,.0f} MB JSONL, {documents:,} documents, {text_bytes / 1e6:,.0f} MB of "
        f"text, byte-level BPE 8,192, {len(manifest['shards'])} shards):",
        "",
        "| | seconds | MB of text/s | per core | tokens/s | tokens/s per core |",
        "|---|---|---|---|---|---|",
        f"| bare `encode_batch_fast` (same batches, calls only) | {bare_s:.1f} | {bare_mb_s:.2f} | "
        f"{bare_mb_s / cores:.2f} | {bare_tokens / bare_s:,.0f} | "
        f"{bare_tokens / bare_s / cores:,.0f} |",
        f"| `decoupled_diloco.data.prepare`, end to end | {prep_s:.1f} | {mb_s:.2f} | "
        f"{mb_s / cores:.2f} | {tokens / prep_s:,.0f} | {tokens / prep_s / cores:,.0f} |",
        "",
        f"- Prepare / bare tokenizer: **{bare_s / prep_s:.3f}** (target >= 0.8). Prepare also "
        "reads and parses the JSONL, splits, writes and hashes the shards; the bare side is the "
        "tokenizer calls alone.",
        f"- Loader: **{loader / 1e6:.2f}M tokens/s** out of the memory-mapped shards at sequence "
        "1024, batch 32, one learner, one process (goal >= 5M per host).",
        f"- Data wait of `lm_125m` (float32 with remat, CPU, batch {DATA_WAIT_BATCH} x 1024): "
        f"{1e3 * wait_s:.2f} ms per batch "
        f"beside a {step_s:.2f} s step: **{100 * wait_s / (wait_s + step_s):.3f}%** of the step "
        "(target <= 1%).",
        f"- Memory, `tiny_lm` dp learner, {args.rss_steps} steps of 8 x 1024 tokens: peak RSS "
        f"**{rss_small['peak_mb']:,.0f} MB** on a 10 MB corpus, **{rss_big['peak_mb']:,.0f} MB** "
        f"on {big_bytes / 1e9:.1f} GB: **{100 * (growth - 1):+.1f}%** "
        f"(target within 5%). Opening the big corpus with every SHA-256 checked took "
        f"{verify_s:.1f} s (writing it {big_write_s:.0f} s).",
        f"- This benchmark process's own peak RSS: {self_rss:,.0f} MB.",
        "",
    ]
    section.write(args.out, "\n".join(lines))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
