"""The fields of the decoupled processes: syncer, compression, local supervisor, live monitor.

The rest of the experiment's fields are in `schema`. No JAX is imported here (see `schema`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    """The syncer process: address, admission, transport limits and timing.

    `token` is the run token every RPC must carry; empty means "read `DD_RUN_TOKEN` from the
    environment" (the launcher sets a random one, so it never shows up on a command line).
    `tls_cert`/`tls_key` (PEM paths) switch the server to TLS; learners then trust `tls_cert`.

    Attributes:
      host: address the syncer binds to (use 0.0.0.0 to accept learners on other hosts).
      port: port the syncer listens on; 0 picks a free one.
      token: the run token; empty reads `DD_RUN_TOKEN` (keep it off command lines).
      tls_cert: PEM certificate of the syncer; set with `tls_key` to serve TLS.
      tls_key: PEM private key of the syncer.
      chunk_bytes: bytes per gRPC stream message of a push or pull (at least 1024).
      max_push_bytes: the largest push the syncer accepts.
      rpc_timeout_s: deadline of one control RPC; a push or pull is cut once it moves nothing
        this long (however long it takes as a whole; a push's reply also waits for what a slow
        link still holds queued); also the longest a pull waits for a merge. gRPC's own ping
        timeout is 10 times this, at least 60 s (a ping waits behind a saturated link's queue).
      retries: retries of a failed RPC (with backoff) before the learner reports an error.
      heartbeat_s: seconds between a learner's heartbeats.
      learner_timeout_s: a learner silent this long (no heartbeat, lease request or push
        chunk) no longer counts towards the quorum, and its data leases are handed again.
      max_grace_s: upper bound of the adaptive grace window, in seconds.
      max_staleness: pushes anchored more than this many versions behind are refused as late
        (their learner sends the work again with its next push, `FragmentState.rebase`; in
        a multi-process island their batches are handed out again instead).
      shards: S syncer processes; shard s owns the fragments p with p % S == s, keeps its own
        checkpoints, and fails alone (learners keep syncing the other shards' fragments).
      snapshot_s: a checkpointing syncer writes an Orbax snapshot of its state at most this
        often (and at least 4x as long apart as the last one took to write); in between, every
        change goes to its write-ahead log first (merged versions and acknowledgements wait
        for the log's disk sync, not for snapshots; see `syncer.durability`).
      max_unsent: undelivered pushes a learner keeps per fragment while its syncer is down
        (beyond that the oldest is dropped and counted; see `learner.outbox`).
      max_delta_norm: a push whose outer-gradient norm exceeds this times its fragment's norm
        is refused (`syncer.admission`); honest outer gradients stay far below it.
      max_weight_share: in a merge of 2+ pushes, no push's token-weight share exceeds this.
      max_inflight_bytes: push payload bytes the syncer receives at once (0: twice
        `num_learners` times the model's float32 bytes: each learner pushes every fragment at
        once at most, and a final push beside it); they go to its push store on disk as they
        arrive, not to memory. Beyond it a push is refused at once (RESOURCE_EXHAUSTED,
        retried by learners): gRPC would buffer a waiting push's chunks in memory. A refused
        push has already sent a flow-control window's bytes: behind a slow link, refusals
        cost link time.
      max_streams_per_learner: data calls one learner may hold open (0: what its link opens at
        most, fragments · (max_unsent + 1) + 2).
      max_transfers: a learner's pushes, and bodies of its pulls, that cross its data
        connection at once, each way (0: no bound). They share one TCP connection, so more at
        once only split its rate; and behind a slow link gRPC split it so unevenly that, of
        4 pulls at once at 0.14 Mbit/s, three moved nothing for 35-39 s, past the bounds that
        cut a stalled stream; one at a time, at most 10 s (`tools/wan_streams.py`,
        benchmarks/results/wan.md, "One transfer at a time").
      stream_idle_s: a push stream that moves nothing this long is cut (a pull: see
        `min_pull_bytes_per_s`).
      min_pull_bytes_per_s: a pull's reply is cut once it has taken `stream_idle_s` plus its
        bytes at this rate, shared by the learner's replies under way at once (the syncer
        cannot see a reader's pace chunk by chunk behind flow control and socket buffers;
        `syncer.guard`).
      durable: the local launcher gives every syncer shard a checkpoint directory (write-ahead
        log and snapshots), so that a syncer killed in any way restarts with nothing lost.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    chunk_bytes: int = 1 << 20
    max_push_bytes: int = 1 << 30
    rpc_timeout_s: float = 60.0
    retries: int = 5
    heartbeat_s: float = 0.5
    learner_timeout_s: float = 30.0
    max_grace_s: float = 10.0
    max_staleness: int = 4
    shards: int = 1
    snapshot_s: float = 10.0
    max_unsent: int = 4
    max_delta_norm: float = 10.0
    max_weight_share: float = 0.8
    max_inflight_bytes: int = 0
    max_streams_per_learner: int = 0
    max_transfers: int = 1
    stream_idle_s: float = 30.0
    min_pull_bytes_per_s: float = 8192.0
    durable: bool = True


@dataclasses.dataclass(frozen=True)
class DecoupledConfig:
    """Decoupled DiLoCo: fragments, overlap, quorum, merge-back and heterogeneity knobs.

    The defaults are the best measured algorithm ("gather + share", benchmarks/results/
    decoupled.md and merge_lag.md): τ = H/5 steps of overlap give the grace window (γ = 1, up to
    10 s) room to gather every learner's push of a round into one merge while nobody waits; the
    steps trained meanwhile are kept (`keep_overlap`); a merge of k of M learners steps k/M of
    the way (`partial_merge="share"`), so lone pushes are not overweighted; a merge is applied
    as soon as it arrives (`apply_on_arrival`).

    `mesh_shapes` gives each learner its own mesh, e.g. "1x1,2x1" (empty: all use `mesh.shape`).
    `dynamic_local_updates` (Async Local-SGD's DyLU) scales a learner's H by its speed relative
    to the fastest learner, so that slow learners sync as often in wall time as fast ones.
    `stale_anchor` says how a push anchored at an older version enters a merge: "syncer"
    re-anchors it at the current global value (Θ − θ_m, Decoupled DiLoCo App. D.2); "learner"
    keeps the learner's own outer gradient (Θ^(base) − θ_m, as Async Local-SGD applies stale
    pseudo-gradients).

    Attributes:
      fragments: P, groups the parameters are cut into; each is synced on its own staggered
        schedule (P <= H).
      overlap_steps: τ, inner steps between a fragment's push and applying its merged value
        (with `apply_on_arrival`: the slack that sizes the syncer's grace window); -1: H // 5
        (10 at H = 50).
      quorum: K, pushes that close a fragment's round (before the grace window).
      alpha: 0 overwrites a fragment with the merged value; α > 0 keeps α·local + (1−α)·global.
      keep_overlap: on arrival, keep the τ steps trained while the fragment was in flight:
        θ ← merged + (θ − θ_at_push) (as Streaming DiLoCo's eager updates keep local progress),
        instead of overwriting them; those steps then enter the fragment's next push.
      apply_on_arrival: apply a merged fragment at the first step boundary after it arrives,
        even before τ steps have passed (τ then only sizes the syncer's grace window): fewer
        steps trained away from the merged value when the merge comes back early.
      wait_for_merge: the learner waits, once a merge is due (τ steps after its push, or at
        once with `apply_on_arrival`), until the merge its push is in has arrived, instead of
        stepping on: with 1 fragment, quorum M and τ 0 this is synchronous DiLoCo across the
        syncer (what a slow link costs it shows as waiting). Off: learners never wait.
      partial_merge: how a merge that holds k of the M learners' pushes steps: "mean" (the
        weighted mean of the k outer gradients, as if they were all) or "share" (that mean
        scaled by k/M: a lone asynchronous push moves the fragment 1/M of a full round's way).
      grace_safety: γ, the share of the learner's slack spent waiting for more pushes (Eq. 3).
      ema_decay: decay of the syncer's moving averages of step, quorum and sync times.
      mesh_shapes: per-learner meshes, e.g. "1x1,2x1"; empty: every learner uses `mesh.shape`.
      dynamic_local_updates: scale each learner's H by its speed relative to the fastest one.
      stale_anchor: "syncer" re-anchors a stale push at the current global value; "learner"
        keeps the learner's own outer gradient.
      island_processes: processes (hosts) per learner island on JAX's multi-controller runtime
        (`jax.distributed`); the local launcher starts this many per learner (on 127.0.0.1,
        or each in a site of its own, `wan_sites`). 1: one process per island. See
        decoupled_diloco/learner/multihost.py.
      island_heartbeat_s: a multi-process island's processes are all stopped (and restarted
        together) when one misses JAX's coordination heartbeats for this many seconds. Raise
        it where the island's own links are slow: across sites (`wan_sites="process"`) a
        gradient all-reduce that fills a slow link starves them (seen: 10 s at 0.15 Mbit/s).
      wan_mbit: the local launcher puts each learner in its own network namespace behind a
        kernel rate limit (`tc tbf`, this many Mbit/s each way; needs root and iproute2, else
        the learners' links are paced in-process and the launcher says so); 0: no limit.
        See decoupled_diloco/local/wan.py.
      wan_sites: with `wan_mbit`, what one namespace (one site, one data centre) holds:
        "learner" (a whole island; the WAN lies between islands) or "process" (each process of
        a multi-process island: the island spans sites and its own collectives cross the
        links, as data-parallel training across data centres does).
      max_learners: learner ids in [0, max_learners) may register, so learners beyond the
        starting `num_learners` can join a running job; 0: twice `num_learners`.
      data_shards: S, the training data is cut into this many shards, and the run's token
        budget (`num_learners` · `train_steps` batches, whoever trains them) into S leases
        that the syncer hands to learners as they ask (its data ledger, see
        decoupled_diloco/syncer/ledger.py): a learner that dies loses compute, not data (its
        lease is handed again from the last accepted position), a learner that joins takes
        its share, and the run ends when the whole budget is in the global model, so a
        learner's own step count follows its speed. 0: static shards (learner i trains windows
        i, i + M, ... for `train_steps` steps; its batches after its last checkpoint are
        skipped when it restarts; no joins). Fewer leases where one would hold fewer than
        `inner_steps` batches. Leases need one syncer shard: with
        `syncer.shards` > 1 the shards are static.
      max_lease_grants: a lease still not covered after it was handed this many times is
        given up, its missing windows reported in the data ledger (`missing_ranges` with
        `handed`, `leases_given_up`), rather than handed and trained again without end: data
        whose pushes keep being refused (late, behind a link too slow for the push schedule)
        would otherwise be retrained forever. 0: no bound.
      global_batch: with data leases, what stays fixed while membership changes.
        "per_learner": every step trains one batch of `data.batch_size` rows, so the rows
        all live learners train per step (the global batch) grow and shrink with them.
        "constant": the global batch stays `num_learners` · `data.batch_size` rows: the
        ledger counts units of `lease_unit` rows and a learner trains about
        `num_learners` · `data.batch_size` / live learners rows per step (whole units, at
        least one; the live count is the syncer's, told in every heartbeat and lease
        reply), so that every outer round holds the same data whatever the membership.
        Each new batch shape compiles the step once. Not for multi-process islands.
      align_phase: a learner that starts its loop while others train (a join, a restart)
        takes the push phase of the most advanced live learner (`Schedule.align`, from the
        syncer's `lead_step` in heartbeat replies), so that its pushes of a round arrive with
        theirs and are merged together. Off: its fragments are due by its own step count.
        Single-process islands only (the processes of one island would hear it apart), and
        not with `dynamic_local_updates` (each learner's H follows its own speed there).
      lease_unit: "constant": rows the ledger counts as one unit; it must divide
        `data.batch_size` and be a multiple of every learner's data-parallel size. 0: the
        least common multiple of the data-parallel sizes of `mesh_shapes`.
      syncer: the syncer's address, security, transport and timing.
    """

    fragments: int = 4
    overlap_steps: int = -1
    quorum: int = 1
    alpha: float = 0.0
    keep_overlap: bool = True
    apply_on_arrival: bool = True
    wait_for_merge: bool = False
    partial_merge: str = "share"
    grace_safety: float = 1.0
    ema_decay: float = 0.8
    mesh_shapes: str = ""
    dynamic_local_updates: bool = False
    stale_anchor: str = "learner"
    island_processes: int = 1
    island_heartbeat_s: int = 10
    wan_mbit: float = 0.0
    wan_sites: str = "learner"
    max_learners: int = 0
    data_shards: int = 64
    max_lease_grants: int = 8
    global_batch: str = "per_learner"
    align_phase: bool = True
    lease_unit: int = 0
    syncer: SyncerConfig = SyncerConfig()


COMPRESSION_SCHEMES = ("none", "bf16", "int8", "int4", "e3m0", "topk")
TOPK_VALUE_SCHEMES = ("none", "bf16", "int8", "int4", "e3m0")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Compression of the decoupled mode's outer gradients (see docs/compression.md).

    Attributes:
      scheme: "none" (float32), "bf16", "int8" / "int4" (blockwise absmax scale), "e3m0"
        (4-bit float without mantissa: signed powers of two times a blockwise scale) or
        "topk" (the `density` largest entries of every block, values coded by `topk_values`).
      block_size: elements per scale block (int8, int4, e3m0) or per top-k chunk (topk,
        at most 65536).
      density: topk: share of each chunk's entries that is sent, in (0, 1].
      topk_values: topk: how the kept values are coded ("none", "bf16", "int8", "int4",
        "e3m0"; one scale per chunk).
      error_feedback: the learner keeps what compression dropped (the residual, part of its
        checkpoint) and adds it to the fragment's next outer gradient.
      ef_decay: error feedback: the residual is multiplied by this before it is added (1: all
        of it; below 1 it decays like an outer momentum, as in SparseLoCo's β).
      keep_unsent: error feedback: when the merged fragment answering a push arrives, the
        learner keeps what that push left unsent in its parameters (θ ← merged − residual),
        so its own progress is never set back by compression; the next push's outer gradient
        (anchor − θ) holds it, so that push does not add the residual again (which stays
        buffered until then, for checkpoints).
      downlink: the syncer also compresses merged fragments sent back to learners (as the
        difference from the copy that learner holds, with the same scheme).
    """

    scheme: str = "none"
    block_size: int = 256
    density: float = 0.02
    topk_values: str = "int4"
    error_feedback: bool = False
    ef_decay: float = 1.0
    keep_unsent: bool = False
    downlink: bool = False


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    """How the local launcher restarts its processes, after a fault's kill or any other death.

    Any death it did not cause counts too: a kill from outside, an out-of-memory kill, a crash.
    An unexpected death is restarted after a backoff (`restart_backoff_s`, doubling per
    consecutive death, up to 30 s); a process that dies `crash_loop` times in a row within
    `min_uptime_s` of its start, or more than `max_restarts` times in all, ends the run with
    its name and the tail of its log.

    Attributes:
      standby: warm spare learner processes kept per learner mesh shape (decoupled mode,
        single-process islands, under a fault schedule): a killed learner is restarted by
        activating one (imports, devices and compiled step done ahead) instead of starting a
        new process; 0: a new process (see docs/chaos.md).
      max_restarts: unexpected deaths one process may have in a run before it fails the run.
      restart_backoff_s: wait before restarting a process after its first unexpected death.
      crash_loop: consecutive quick deaths (see `min_uptime_s`) that end the run at once.
      min_uptime_s: a process that dies sooner than this after its start died quickly.
    """

    standby: int = 0
    max_restarts: int = 5
    restart_backoff_s: float = 1.0
    crash_loop: int = 3
    min_uptime_s: float = 20.0


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Operating a decoupled run (docs/operations.md): Prometheus metrics and the job page.

    With `enabled`, the local launcher starts every process (each syncer shard, each learner)
    with a Prometheus `/metrics` endpoint, serves a live page of the whole job, prints their
    URLs, and writes `workdir/prometheus_targets.json` (Prometheus `file_sd_configs`) and the
    metrics-only `workdir/scrape_token`. Every request must carry the run token or that scrape
    secret.

    Attributes:
      enabled: serve metrics and the page (decoupled mode).
      host: interface the page and the endpoints bind ("127.0.0.1": this machine only).
      port: the page's port (0: any free one).
      refresh_s: seconds between the page's polls of the syncer (and its refreshes).
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    refresh_s: float = 2.0
