"""Security: the hostile-peer attacks of issue 18 against a real syncer process, as measured.

  python -m tools.bench_security --out=benchmarks/results/security.md

A syncer process (a 2-layer d_model-256 model, 2 fragments, quorum 2, learners 0 and 1
registered) is attacked by this process with messages built from the generated protobuf classes
and raw chunk bytes. For every attack: the status code, whether the syncer's state changed
(versions, merges, pending pushes, and every fragment's values pulled and compared), its RSS
before and after, and the slowest Status call while the attack ran. Then Status latency with
100 hostile idle streams open, and the syncer's memory with far more concurrent pushes than
`max_inflight_bytes` admits. Targets: state unchanged by every attack, Status p99 ≤ 100 ms with
the idle streams, push bytes in flight and what the concurrent pushes add to the syncer's peak
RSS (over the peak of the same pushes made one at a time) ≤ the configured bound.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import pathlib
import random
import tempfile
import threading
import time
import zlib

import grpc
import numpy as np

from tools.benchkit import Section, serving

TOKEN = "bench-security-token"
SERVICE = "/decoupled_diloco.Syncer/"
INFLIGHT = 16 << 20  # max_inflight_bytes for the run


def _config():
    from decoupled_diloco import config as config_lib

    base = config_lib.ExperimentConfig(
        mode="decoupled",
        num_learners=2,
        train_steps=1000,
        model=config_lib.ModelConfig(
            vocab_size=256, d_model=256, num_layers=2, num_heads=4, mlp_hidden=1024, seq_len=64
        ),
    )
    return config_lib.replace(
        base,
        **{
            "decoupled.fragments": 2,
            "decoupled.quorum": 2,
            "decoupled.syncer.max_grace_s": 0.0,
            "decoupled.syncer.stream_idle_s": 2.0,
            "decoupled.syncer.rpc_timeout_s": 5.0,
            "decoupled.syncer.max_inflight_bytes": INFLIGHT,
        },
    )


class Attacker:
    """Raw calls on the syncer, by method path."""

    def __init__(self, port: int, pb, secret: str = TOKEN):
        self.pb, self.port = pb, port
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 128 << 20)]
        )
        self.md = (("x-dd-run-token", secret),)

    def unary(self, method, request, reply, secret=None, timeout=30.0):
        """One unary call; `request` may be raw bytes."""
        call = self.channel.unary_unary(
            SERVICE + method,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=reply.FromString,
        )
        md = self.md if secret is None else (("x-dd-run-token", secret),)
        return call(request, timeout=timeout, metadata=md)

    def status(self) -> dict:
        """The syncer's status."""
        return json.loads(self.unary("Status", self.pb.StatusRequest(), self.pb.StatusReply).json)

    def push(self, chunks, timeout=30.0):
        """A push of raw chunk bytes."""
        call = self.channel.stream_unary(SERVICE + "Push", request_serializer=None)
        return call(iter(chunks), timeout=timeout, metadata=self.md)

    def pull(self, timeout=30.0, **fields):
        """A pull; its raw reply chunks."""
        call = self.channel.unary_stream(
            SERVICE + "Pull", request_serializer=self.pb.PullRequest.SerializeToString
        )
        return list(call(self.pb.PullRequest(**fields), timeout=timeout, metadata=self.md))


def _rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _code(fn) -> str:
    try:
        fn()
        return "OK"
    except grpc.RpcError as error:
        return error.code().name


def _state(a: Attacker, num_fragments: int):
    s = a.status()
    digest = []
    for p in range(num_fragments):
        raw = b"".join(a.pull(learner_id=-1, fragment=p, min_version=0, wait_s=0.0))
        digest.append(zlib.crc32(raw))
    learners = {k: (v["state"], v["step"]) for k, v in s["learners"].items()}
    return (
        [f["version"] for f in s["fragments"]],
        s["merges"],
        [f["pending"] for f in s["fragments"]],
        digest,
        learners,
    )


def _headers(pb, specs, scheme="none"):
    return [
        pb.TensorHeader(
            name=s.name,
            shape=list(s.shape),
            dtype=s.dtype,
            scheme=scheme,
            format_version=1,
            payload_bytes=math.prod(s.shape) * 4,
        )
        for s in specs
    ]


def _chunks(
    pb, specs, value, learner=0, rnd=0, steps=4, tokens=None, inc=0, extra=0, reorder=False, base=0
):
    tokens = steps * 64 * 16 if tokens is None else tokens
    payload = b"".join(np.full(s.shape, value, "<f4").tobytes() for s in specs)
    header = pb.PushHeader(
        learner_id=learner, fragment=0, round=rnd, steps=steps, tokens=tokens,
        tensors=_headers(pb, specs), total_bytes=len(payload),
        incarnation=inc, base_version=base,
    )  # fmt: skip
    pieces = [payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
    out = [pb.PushChunk(header=header, data=pieces[0]).SerializeToString()]
    out += [pb.PushChunk(seq=i, data=d).SerializeToString() for i, d in enumerate(pieces[1:], 1)]
    out += [
        pb.PushChunk(seq=len(out) + i, data=b"\0" * (1 << 20)).SerializeToString()
        for i in range(extra)
    ]
    if reorder and len(out) > 2:
        out[1], out[2] = out[2], out[1]
    crc = zlib.crc32(payload + b"\0" * ((1 << 20) * extra))
    return out + [pb.PushChunk(seq=len(out), payload_crc32=crc).SerializeToString()]


def run(out: pathlib.Path) -> None:
    from decoupled_diloco.comm import auth
    from decoupled_diloco.comm import syncer_pb2 as pb
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.tasks import make_task

    config = _config()
    partition, _ = initial_fragments(config)
    specs = partition[0]
    fingerprint_specs = sorted((s for f in partition for s in f), key=lambda s: s.index)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_security_"))
    rows, extra_lines = [], []
    with serving(config, tmp, TOKEN, cleanup=True) as served:
        syncer, port = served.proc, served.port
        a = Attacker(port, pb)
        grpc.channel_ready_future(a.channel).result(timeout=60)
        inc = {}
        for i in (0, 1):
            reply = a.unary(
                "Register",
                pb.RegisterRequest(
                    learner_id=i, fingerprint=make_task(config).fingerprint(fingerprint_specs)
                ),
                pb.RegisterReply,
            )
            inc[i] = reply.incarnation
        as0 = Attacker(port, pb, auth.learner_credential(TOKEN, 0))

        def attack(name, fn, during=False):
            before, rss0 = _state(a, 2), _rss_mb(syncer.pid)
            latencies, stop = [], threading.Event()

            def probe():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        a.status()
                    except grpc.RpcError:
                        latencies.append(float("inf"))
                    latencies.append(time.perf_counter() - t0)

            prober = threading.Thread(target=probe)
            prober.start()
            try:
                codes = fn()
            finally:
                stop.set()
                prober.join()
            time.sleep(0.2)
            after, rss1 = _state(a, 2), _rss_mb(syncer.pid)
            rows.append(
                (name, codes, "no" if before == after else "**yes**", rss0, rss1,
                 1e3 * max(latencies or [0.0]))
            )  # fmt: skip
            print(f"[security] {rows[-1]}", flush=True)

        def pusher(**kw):
            kw.setdefault("inc", inc[kw.get("learner", 0)])
            value = kw.pop("value", 1e-3)
            return lambda: a.push(_chunks(pb, specs, value, **kw))

        def push(**kw):
            return _code(pusher(**kw))

        def pull_far(who, wait_s):
            return lambda: who.pull(
                learner_id=0, fragment=0, min_version=2**62, wait_s=wait_s, timeout=60
            )

        def beat(who, secret=None, mb=60, **fields):
            request = pb.HeartbeatRequest(**fields) if fields else b"\x0a" + b"\xff" * (mb << 20)
            return _code(lambda: who.unary("Heartbeat", request, pb.HeartbeatReply, secret=secret))

        def many(fns):
            with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
                got = sorted({c for c in pool.map(_code, fns)})
            return "/".join(got)

        attack("1. push with tokens=0", lambda: push(tokens=0))
        attack("2a. finite payload of 1e20", lambda: push(value=1e20, rnd=1))

        def int8_scale():
            headers, parts = [], []
            for s in specs:
                n = math.prod(s.shape)
                blocks = -(-n // 256)
                parts += [
                    np.full(blocks, 3e38, "<f4").tobytes(),
                    np.full(n, 127, np.int8).tobytes(),
                ]
                headers.append(pb.TensorHeader(name=s.name, shape=list(s.shape), dtype=s.dtype,
                               scheme="int8", block_size=256, format_version=1,
                               payload_bytes=4 * blocks + n))  # fmt: skip
            payload = b"".join(parts)
            header = pb.PushHeader(
                learner_id=0, fragment=0, round=2, steps=4, tokens=4096, tensors=headers,
                total_bytes=len(payload), incarnation=inc[0],
            )  # fmt: skip
            chunks = [payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
            msgs = [pb.PushChunk(header=header, data=chunks[0]).SerializeToString()]
            msgs += [
                pb.PushChunk(seq=i, data=c).SerializeToString() for i, c in enumerate(chunks[1:], 1)
            ]
            msgs.append(
                pb.PushChunk(seq=len(msgs), payload_crc32=zlib.crc32(payload)).SerializeToString()
            )
            return _code(lambda: a.push(msgs))

        attack("2b. int8 block scales of 3e38", int8_scale)
        attack(
            "3. 5 superseding pushes, tokens=2^63-1, steps=1",
            lambda: many([pusher(rnd=10 + r, steps=1, tokens=2**63 - 1) for r in range(5)]),
        )
        attack("4. tokens=10^9, steps=1", lambda: push(rnd=20, steps=1, tokens=10**9))
        attack("5. 22 pulls with wait_s=NaN", lambda: many([pull_far(a, float("nan"))] * 22))

        def idle_streams(n, who):
            stop = threading.Event()

            def silent():
                yield from ()
                stop.wait(60)

            call = who.channel.stream_unary(SERVICE + "Push", request_serializer=None)
            calls = [call.future(silent(), metadata=who.md) for _ in range(n)]
            got = set()
            for c in calls:
                try:
                    c.result(timeout=60)
                    got.add("OK")
                except grpc.RpcError as error:
                    got.add(error.code().name)
            stop.set()
            return "/".join(sorted(got))

        attack("6a. 22 push streams sending nothing (learner 0)", lambda: idle_streams(22, as0))
        attack("6b. 22 pulls for version 2^62, wait_s=1e9", lambda: many([pull_far(as0, 1e9)] * 22))
        attack(
            "7. 3 pushes with 64 MiB past their declared size",
            lambda: many([pusher(rnd=30 + r, extra=64) for r in range(3)]),
        )
        attack("8a. a 60 MB Heartbeat with a wrong token", lambda: beat(a, secret="wrong"))
        attack("8b. a 6 MB Heartbeat with a wrong token", lambda: beat(a, secret="wrong", mb=6))
        attack(
            "9a. a heartbeat with 8M versions",
            lambda: beat(a, learner_id=0, versions=[1] * (8 << 20)),
        )
        attack(
            "9b. a heartbeat with 1M versions",
            lambda: beat(a, learner_id=0, versions=[1] * (1 << 20)),
        )

        def unregistered(i):
            return lambda: a.pull(learner_id=1000 + i, fragment=0, min_version=0, wait_s=0.0)

        attack(
            "10. pulls as 1,500 unregistered learner ids",
            lambda: "/".join(sorted({_code(unregistered(i)) for i in range(1500)})),
        )

        def as_other():
            return as0.push(_chunks(pb, specs, 1e-3, learner=1, rnd=40, inc=inc[1]))

        attack("11a. learner 0's credential pushing as learner 1", lambda: _code(as_other))
        attack(
            "11b. learner 0's credential marking 1 done",
            lambda: beat(as0, learner_id=1, state="done"),
        )

        def replay():
            chunks = _chunks(pb, specs, 1e-3, learner=1, rnd=50, inc=inc[1])
            inc[1] = a.unary(
                "Register",
                pb.RegisterRequest(
                    learner_id=1, fingerprint=make_task(config).fingerprint(fingerprint_specs)
                ),
                pb.RegisterReply,
            ).incarnation
            return _code(lambda: a.push(chunks))

        attack("11c. a replay after re-registration", replay)
        attack("12. data chunks reordered", lambda: push(rnd=60, reorder=True))

        # Status p99 with 100 hostile idle streams open (run token: the most streams allowed).
        stop = threading.Event()

        def silent():
            yield from ()
            stop.wait(60)

        idle = Attacker(port, pb)
        call = idle.channel.stream_unary(SERVICE + "Push", request_serializer=None)
        calls = [call.future(silent(), metadata=idle.md) for _ in range(100)]
        time.sleep(0.5)
        lat, t_end = [], time.monotonic() + 4.0  # past `stream_idle_s`: the idle cuts happen
        while len(lat) < 200 or time.monotonic() < t_end:
            t0 = time.perf_counter()
            a.status()
            lat.append(time.perf_counter() - t0)
        stop.set()
        open_codes = set()
        for c in calls:
            try:
                c.result(timeout=60)
            except grpc.RpcError as error:
                open_codes.add(error.code().name)
        lat_ms = np.array(lat) * 1e3
        extra_lines.append(
            f"- **Status latency with 100 hostile idle push streams open** ({len(lat)} calls over "
            "4.5 s): "
            f"p50 {np.percentile(lat_ms, 50):.1f} ms, p99 {np.percentile(lat_ms, 99):.1f} ms, "
            f"max {lat_ms.max():.1f} ms (target p99 ≤ 100 ms); the streams ended "
            f"{'/'.join(sorted(open_codes))} (refused beyond the data slots, or cut after "
            f"`stream_idle_s` = 2 s)."
        )

        # Memory with the most concurrent pushes: 40 slow pushes of one fragment at once, after
        # the same 40 pushes one at a time (their merges fill the version history to its bound,
        # so the state has reached its size: what grows after that is the pushes' own memory).
        # Each push is made as a learner makes it: anchored at the fragment's current version,
        # retried with backoff while the syncer is at a capacity bound, until it is answered.
        frag_bytes = sum(math.prod(s.shape) * 4 for s in specs)

        def learner_push(r, rnd, slow):
            retries, delay, deadline = 0, 0.05, time.monotonic() + 180
            while True:
                try:  # 40 callers at once: the operator's control calls may be refused too
                    base = a.status()["fragments"][0]["version"]
                    chunks = _chunks(pb, specs, 1e-3, r % 2, rnd, inc=inc[r % 2], base=base)

                    def gen(chunks=chunks):
                        for c in chunks:
                            if slow:
                                time.sleep(0.05)
                            yield c

                    reply = pb.PushReply.FromString(a.push(gen(), timeout=60))
                    return ("accepted" if reply.accepted else reply.reason or "refused"), retries
                except grpc.RpcError as error:
                    code = error.code()
                    if code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        return code.name, retries
                retries += 1
                time.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 1.0)

        def outcomes(results):
            counts = collections.Counter(o for o, _ in results)
            return ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))

        peak, done = [0.0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], _rss_mb(syncer.pid))
                time.sleep(0.01)

        def watched(pushes):
            """The pushes' outcomes, and the syncer's peak RSS while they ran."""
            peak[0] = 0.0
            done.clear()
            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                return pushes(), peak[0]
            finally:
                done.set()
                watcher.join()

        def slow(r, rnd):
            return learner_push(r, rnd, slow=True)

        rss_start = _rss_mb(syncer.pid)
        one_by_one, peak_one = watched(lambda: [slow(r, 500 + r) for r in range(40)])
        rss0 = _rss_mb(syncer.pid)
        refused0 = a.status()["guard"]["refused"]
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            at_once, peak_all = watched(lambda: list(pool.map(slow, range(40), range(1000, 1040))))
        guard = a.status()["guard"]
        extra_lines.append(
            f"- **40 concurrent pushes of a {frag_bytes / 2**20:.1f} MiB fragment** with "
            f"`max_inflight_bytes` = {INFLIGHT / 2**20:.0f} MiB, each anchored at the current "
            f"version and retried with backoff while refused, as a learner does: outcomes "
            f"{outcomes(at_once)}, after {sum(n for _, n in at_once)} retries "
            f"({guard['refused'] - refused0} refused by the in-flight bound; past it a push is "
            f"refused at once, not held); peak push bytes in flight "
            f"{guard['peak_bytes_in_flight'] / 2**20:.1f} MiB (target ≤ "
            f"{INFLIGHT / 2**20:.0f} MiB). Syncer RSS {rss_start:.0f} MB before the same 40 "
            f"pushes one at a time ({outcomes(one_by_one)}; peak {peak_one:.0f} MB while they ran, "
            f"{rss0:.0f} MB after them: merged versions fill the version history to its bound), "
            f"peak **{peak_all:.0f} MB while the 40 ran at once: {peak_all - peak_one:+.0f} MB** "
            f"over the peak one at a time (target ≤ {INFLIGHT / 2**20:.0f} MiB; "
            f"{peak_all - rss0:+.0f} MB over the RSS after them). Not covered by the bound: gRPC "
            "receives each open stream's current message (a chunk, at most 8 MiB) before a "
            "handler sees it, for at most the data slots' number of streams. Before 2026-12-05 "
            "pushes waited for room (up to `stream_idle_s`) instead of being refused, and gRPC "
            "went on receiving their chunks meanwhile: on that code the 40 at once peaked "
            "+127 MB over the RSS after the pushes one at a time (and 25 of the 40 were late: "
            "they waited)."
        )
        # SIGTERM with all of the above behind it, and 22 pulls waiting.
        waiting = concurrent.futures.ThreadPoolExecutor(22)
        for _ in range(22):
            waiting.submit(_code, pull_far(as0, 1e9))
        time.sleep(0.5)
        t0 = time.perf_counter()
        syncer.terminate()
        syncer.wait(timeout=60)
        extra_lines.append(
            f"- **SIGTERM** with 22 pulls waiting: the syncer exited in "
            f"{time.perf_counter() - t0:.2f} s (code {syncer.returncode}; target ≤ 5 s)."
        )
        waiting.shutdown(wait=False, cancel_futures=True)
    section = Section("security")
    unchanged = sum(r[2] == "no" for r in rows)
    section.claim(
        "hostile-peer attacks leaving the syncer unchanged",
        f"{unchanged} of {len(rows)}",
        headline=True,
        section="Security (hostile peers)",
    )
    lines = [
        "## Security (hostile peers)\n",
        f"{section.header()} "
        "A real syncer process (2-layer d_model-256 model, 2 fragments, quorum 2), attacked "
        "with messages built from the generated protobuf "
        'classes; "state changed" compares versions, merges, pending pushes and every '
        "fragment's pulled bytes before and after. Status latency is the slowest Status call "
        "made while the attack ran.\n",
        "| attack | status | state changed | syncer RSS before → after (MB) "
        "| slowest Status during (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, codes, changed, rss0, rss1, slowest in rows:
        lines.append(f"| {name} | {codes} | {changed} | {rss0:.0f} → {rss1:.0f} | {slowest:.0f} |")
    lines += ["", *extra_lines, ""]
    section.write(out, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/security.md")
    args = parser.parse_args()
    run(pathlib.Path(args.out))


if __name__ == "__main__":
    main()
