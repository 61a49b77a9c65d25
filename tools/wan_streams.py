"""Concurrent gRPC streams on one connection behind a slow kernel-shaped link: how even is it?

A learner's pushes and pulls share one TCP connection to the syncer (`comm.client`). This
runs k streams at once, each way, of `--chunks` messages of `--chunk_bytes` through a `tc tbf`
link (`local.wan.WanLab`) with the syncer's channel options (`comm.wire.channel_options`), and
reports each stream's longest gap between two messages (a stream cut once it moves nothing
for the idle bound, `rpc_timeout_s` or the syncer's `stream_idle_s`, is lost work) and the
share of the link's rate the direction got (its bytes over the time its last stream took).
`--duplex` also runs k pulls and k pushes at once: both directions busy on one connection, as
a learner's pushes and the merges it pulls are behind a loaded link (the planner's
`LinkPlan.crossing_efficiency`). With `--calls` > 1 a pull's longest gap includes the gaps
between its calls (the client times them); a push's is within a call (the server's).

  python -m tools.wan_streams --mbit=0.14 --streams=4,1   # needs root and iproute2
  python -m tools.wan_streams --mbit=0.283 --streams=1 --chunks=9 --calls=4 --duplex

Measured results: benchmarks/results/wan.md ("One transfer at a time", "The end played out").
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent import futures

from absl import app, flags

flags.DEFINE_float("mbit", 0.14, "the link's rate, Mbit/s each way")
flags.DEFINE_string("streams", "4,1", "streams at once, comma-separated")
flags.DEFINE_integer("chunks", 9, "messages per stream")
flags.DEFINE_integer("chunk_bytes", 64 << 10, "bytes per message")
flags.DEFINE_string("role", "", "internal: server | client")
flags.DEFINE_string("target", "", "internal: the server's address")
flags.DEFINE_string("mode", "", "internal: down | up | both")
flags.DEFINE_bool("duplex", False, "also k pulls and k pushes at once, on one connection")
flags.DEFINE_integer("calls", 1, "calls one after another per stream (a learner's fragments)")
FLAGS = flags.FLAGS


def _options() -> list:
    from decoupled_diloco.comm import wire
    from decoupled_diloco.config import SyncerConfig

    return wire.channel_options(SyncerConfig())


def serve() -> None:
    """A server of `down` (a stream of messages) and `up` (counts them, longest gap)."""
    import grpc

    def down(request: bytes, _):
        for _ in range(int(request.decode())):
            yield bytes(FLAGS.chunk_bytes)

    def up(stream, _):
        t, worst, n = time.monotonic(), 0.0, 0
        for _ in stream:
            now = time.monotonic()
            worst, t, n = max(worst, now - t), now, n + 1
        return f"{n} {worst:.1f}".encode()

    handler = grpc.method_handlers_generic_handler(
        "s",
        {
            "down": grpc.unary_stream_rpc_method_handler(down),
            "up": grpc.stream_unary_rpc_method_handler(up),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(32), handlers=[handler], options=_options())
    port = server.add_insecure_port("0.0.0.0:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def client(k: int) -> None:
    """Runs k streams at once; prints one line per stream: seconds to its end, longest gap."""
    import grpc

    channel = grpc.insecure_channel(FLAGS.target, options=_options())
    t0 = time.monotonic()

    def down(_: int) -> str:
        t, worst = time.monotonic(), 0.0
        for _ in range(FLAGS.calls):
            for _ in channel.unary_stream("/s/down")(str(FLAGS.chunks).encode()):
                now = time.monotonic()
                worst, t = max(worst, now - t), now
        return f"{time.monotonic() - t0:.1f} {worst:.1f}"

    def up(_: int) -> str:
        worst = 0.0
        for _ in range(FLAGS.calls):  # (the server times the gaps within a call only)
            stream = (bytes(FLAGS.chunk_bytes) for _ in range(FLAGS.chunks))
            worst = max(worst, float(channel.stream_unary("/s/up")(stream).decode().split()[1]))
        return f"{time.monotonic() - t0:.1f} {worst:.1f}"

    kinds = {"down": [down], "up": [up], "both": [down, up]}[FLAGS.mode]
    with futures.ThreadPoolExecutor(k * len(kinds)) as pool:
        jobs = [(f.__name__, pool.submit(f, i)) for f in kinds for i in range(k)]
        for name, job in jobs:
            try:
                print(name, job.result(), flush=True)
            except grpc.RpcError as error:
                print(name, f"error {error.code().name}: {error.details()}", flush=True)


def measure() -> list[str]:
    """The table's rows, lab built and removed here."""
    from decoupled_diloco.local import wan

    rows = []
    with wan.WanLab(1, rate_mbit=FLAGS.mbit) as lab:
        me = [sys.executable, "-m", "tools.wan_streams", f"--chunk_bytes={FLAGS.chunk_bytes}"]
        server = subprocess.Popen(
            lab.in_syncer([*me, "--role=server"]), stdout=subprocess.PIPE, text=True
        )
        try:
            target = f"{lab.syncer_address(0)}:{server.stdout.readline().strip()}"
            for k in (int(x) for x in FLAGS.streams.split(",")):
                for mode in ("down", "up", "both") if FLAGS.duplex else ("down", "up"):
                    out = subprocess.run(
                        lab.in_site(0, [*me, "--role=client", f"--target={target}",
                                        f"--mode={mode}", f"--streams={k}",
                                        f"--chunks={FLAGS.chunks}",
                                        f"--calls={FLAGS.calls}"]),  # fmt: skip
                        capture_output=True, text=True, timeout=1800, check=True,
                    ).stdout  # fmt: skip
                    for way in ("down", "up") if mode == "both" else (mode,):
                        rows.append(_row(way, k, mode == "both", out))
                        print(rows[-1], flush=True)
        finally:
            server.kill()
            server.wait()
    return rows


def _row(way: str, k: int, duplex: bool, out: str) -> str:
    """One table row from the client's lines for direction `way` ("down" or "up")."""
    lines = [x.split(maxsplit=1)[1] for x in out.splitlines() if x.startswith(f"{way} ")]
    ended = [x.split() for x in lines if not x.startswith("error")]
    errors = [x for x in lines if x.startswith("error")]
    last = max((float(e) for e, _ in ended), default=float("nan"))
    gaps = ", ".join(g for _, g in ended) or "-"
    sent = len(ended) * FLAGS.calls * FLAGS.chunks * FLAGS.chunk_bytes
    share = sent * 8 / (last * FLAGS.mbit * 1e6)
    name = {"down": "pull", "up": "push"}[way]
    beside = {"down": " (beside pushes)", "up": " (beside pulls)"}[way] if duplex else ""
    return (
        f"| {name}{beside} | {k} | {last:.1f} | {share:.2f} | {gaps} | {'; '.join(errors) or '-'} |"
    )


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.role == "server":
        return serve()
    if FLAGS.role == "client":
        return client(int(FLAGS.streams))
    mb = FLAGS.chunks * FLAGS.chunk_bytes / 1e6
    print(f"# {FLAGS.mbit:g} Mbit/s each way (tc tbf), {FLAGS.calls} call(s) of {FLAGS.chunks} x "
          f"{FLAGS.chunk_bytes} B ({mb:.2f} MB) per stream, one after another\n")  # fmt: skip
    print("| direction | streams at once | last ended (s) | share of the rate "
          "| longest gap per stream (s) | errors |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    measure()


if __name__ == "__main__":
    app.run(main)
