"""A wide-area network on one machine: learners in their own network namespaces behind `tc tbf`.

`WanLab(num_sites, rate_mbit)` builds, and removes on exit whatever happens:

  root namespace ── veth (unshaped) ── syncer namespace ──┬─ veth, tbf both ways ── site 0
   (launcher, status)                   (the syncer)      ├─ veth, tbf both ways ── site 1
                                                          └─ ...

A site is one data centre: a learner island (all its processes), or with
`decoupled.wan_sites="process"` one process of an island that spans sites (data-parallel over
the WAN: its collectives cross the links). Such sites reach each other through the syncer's
namespace, which then forwards between its site links (`routed`), so site-to-site traffic is
shaped on both links; no site can reach the root namespace.

Each link is a private /30 of `10.X.Y.0` that this lab picked and checked is unused; the syncer
binds 0.0.0.0 inside its own namespace (where only the lab's links exist). A learner reaches
the syncer at its link's syncer-side address, another site at that site's address
(`site_address`); the launcher reaches the syncer at the root link's. The kernel shapes
every byte both ways (`tbf` on each end's egress), so pushes and pulls alike see the rate.
Needs root, `ip` and `tc` (iproute2; `apt-get install iproute2`) and the `sch_tbf` qdisc;
`available()` says whether they are there and why not, so a caller can fall back to the
in-process pacer (`comm.faulty_link`) and say so. The `netem` qdisc is not used (not available
on these machines): latency comes from the link-latency fault.

  with WanLab(4, rate_mbit=20) as lab:
      syncer = lab.in_syncer(["python", "-m", "decoupled_diloco.syncer", "--host=0.0.0.0", ...])
      learner = lab.in_site(0, ["python", "-m", "decoupled_diloco.learner",
                                f"--syncer={lab.syncer_address(0)}:PORT", ...])
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

from decoupled_diloco.chaos import faults

_PREFIX = "dd"  # every namespace and link this module makes starts with it


class WanError(RuntimeError):
    """The lab could not be built (the message says which command failed and why)."""


def available(ip: str = "ip", tc: str = "tc") -> tuple[bool, str]:
    """Whether a lab can be built here: (True, "") or (False, the reason)."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces and qdiscs need CAP_NET_ADMIN)"
    for tool in (ip, tc):
        if shutil.which(tool) is None:
            return False, f"{tool!r} not found (apt-get install iproute2)"
    probe = f"{_PREFIX}probe{secrets.token_hex(2)}"
    try:
        _run([ip, "netns", "add", probe])  # (refused in containers without CAP_SYS_ADMIN)
        try:
            _run([ip, "netns", "exec", probe, ip, "link", "add", probe, "type", "veth",
                  "peer", "name", probe + "p"])  # fmt: skip
            _run([ip, "netns", "exec", probe, tc, "qdisc", "add", "dev", probe, "root",
                  *tbf_args(1.0)])  # fmt: skip
        finally:
            _run([ip, "netns", "del", probe], check=False)  # (its links go with it)
    except WanError as error:
        return False, f"cannot shape a link here: {error}"
    return True, ""


def _run(command: Sequence[str], check: bool = True) -> str:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        if not check:
            return ""
        raise WanError(f"`{' '.join(command)}` did not finish within 30 s") from None
    if check and done.returncode != 0:
        raise WanError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc ... tbf` arguments for `rate_mbit` Mbit/s.

    The bucket holds 10 ms of the rate, and at least 64 KiB so that one segmentation-offloaded
    packet always fits; the queue holds 200 ms before it drops.
    """
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.01), 64 << 10)
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "latency", "200ms"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One veth pair: its two ends, their namespaces and addresses (a /30)."""

    near: str  # the syncer-side (or root-side) end
    far: str
    near_ns: str | None  # None: the root namespace
    far_ns: str
    near_addr: str
    far_addr: str


class WanLab:
    """Network namespaces for a syncer and `num_sites` sites, linked through `tbf`.

    Args:
      num_sites: site namespaces to make (one per learner, or per island process).
      rate_mbit: the rate of every site's link, each way (None: unshaped links).
      ip, tc: the iproute2 tools.
      routed: the sites reach each other (through the syncer's namespace, which then
        forwards between its site links); otherwise each reaches the syncer only.
    """

    def __init__(
        self,
        num_sites: int,
        rate_mbit: float | None,
        ip: str = "ip",
        tc: str = "tc",
        routed: bool = False,
    ):
        self.num_sites, self.rate_mbit, self.ip, self.tc = num_sites, rate_mbit, ip, tc
        self.routed = routed
        tag = secrets.token_hex(2)
        self.tag = tag
        self.syncer_ns = f"{_PREFIX}{tag}s"
        self.site_ns = [f"{_PREFIX}{tag}l{i}" for i in range(num_sites)]
        self.links: list[Link] = []  # [root link, site 0's, site 1's, ...] once built
        self._made_ns: list[str] = []
        self._made_links: list[tuple[str | None, str]] = []

    # Building and removing ----------------------------------------------------------------

    def __enter__(self) -> WanLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Makes the namespaces, links, addresses and qdiscs."""
        blocks = _free_blocks(self.num_sites + 1)
        self._namespace(self.syncer_ns)
        if self.routed:  # (the namespace's own setting; the root namespace's is left alone)
            self._in(self.syncer_ns, ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        root = self._link("r", None, self.syncer_ns, blocks[0])
        self.links.append(root)
        for i, ns in enumerate(self.site_ns):
            self._namespace(ns)
            link = self._link(f"l{i}", self.syncer_ns, ns, blocks[i + 1])
            if self.routed:
                # The other sites, through the syncer's namespace; never the root link's block
                # (the root namespace has no route back: its replies would leave the lab).
                lab_block = str(blocks[0].supernet(new_prefix=24))
                self._in(ns, [self.ip, "route", "add", lab_block, "via", link.near_addr])
                self._in(ns, [self.ip, "route", "add", "prohibit", str(blocks[0])])
            if self.rate_mbit is not None:
                for end, where in ((link.near, link.near_ns), (link.far, link.far_ns)):
                    self._in(where, [self.tc, "qdisc", "add", "dev", end, "root",
                                     *tbf_args(self.rate_mbit)])  # fmt: skip
            self.links.append(link)

    def close(self) -> None:
        """Removes every link and namespace this lab made (what is already gone is skipped)."""
        for where, name in reversed(self._made_links):
            self._in(where, [self.ip, "link", "del", name], check=False)
        for ns in reversed(self._made_ns):
            _run([self.ip, "netns", "del", ns], check=False)
        self._made_links, self._made_ns = [], []

    def _namespace(self, ns: str) -> None:
        _run([self.ip, "netns", "add", ns])
        self._made_ns.append(ns)
        self._in(ns, [self.ip, "link", "set", "lo", "up"])

    def _link(
        self, name: str, near_ns: str | None, far_ns: str, block: ipaddress.IPv4Network
    ) -> Link:
        near, far = f"{_PREFIX}{self.tag}{name}a", f"{_PREFIX}{self.tag}{name}b"
        self._in(near_ns, [self.ip, "link", "add", near, "type", "veth", "peer", "name", far])
        self._made_links.append((near_ns, near))  # (deleting one end deletes the pair)
        self._in(near_ns, [self.ip, "link", "set", far, "netns", far_ns])
        hosts = list(block.hosts())
        link = Link(near, far, near_ns, far_ns, str(hosts[0]), str(hosts[1]))
        for end, where, addr in ((near, near_ns, link.near_addr), (far, far_ns, link.far_addr)):
            self._in(where, [self.ip, "addr", "add", f"{addr}/30", "dev", end])
            self._in(where, [self.ip, "link", "set", end, "up"])
        return link

    def _in(self, ns: str | None, command: list[str], check: bool = True) -> str:
        prefix = [] if ns is None else [self.ip, "netns", "exec", ns]
        return _run(prefix + command, check=check)

    # Using it -----------------------------------------------------------------------------

    def in_syncer(self, command: Sequence[str]) -> list[str]:
        """`command` run inside the syncer's namespace."""
        return [self.ip, "netns", "exec", self.syncer_ns, *command]

    def in_site(self, site: int, command: Sequence[str], own_hostname: bool = False) -> list[str]:
        """`command` run inside site `site`'s namespace.

        With `own_hostname`, also in a UTS namespace of its own whose hostname is the site's
        address: a program that finds its own address from its hostname (gloo, the CPU
        collectives of a JAX program spanning sites) then advertises one its peers can reach.
        """
        command = list(command)
        if own_hostname:
            set_name = f'hostname {self.site_address(site)} && exec "$0" "$@"'
            command = ["unshare", "--uts", "sh", "-c", set_name, *command]
        return [self.ip, "netns", "exec", self.site_ns[site], *command]

    def syncer_address(self, site: int | None = None) -> str:
        """Where site `site` (None: the root namespace, the launcher) reaches the syncer."""
        link = self.links[0] if site is None else self.links[site + 1]
        return link.far_addr if site is None else link.near_addr

    def site_address(self, site: int) -> str:
        """Site `site`'s own address, where the syncer and the other sites reach it."""
        return self.links[site + 1].far_addr

    def sent_bytes(self, site: int) -> tuple[int, int]:
        """(up, down): bytes site `site`'s link has carried towards the syncer and back.

        The kernel's own count (`tc -s`, the `tbf` of each end; headers included); -1 where a
        qdisc is missing (an unshaped lab).
        """
        link = self.links[site + 1]
        out = []
        for end, where in ((link.far, link.far_ns), (link.near, link.near_ns)):
            text = self._in(where, [self.tc, "-s", "qdisc", "show", "dev", end], check=False)
            words = text.split()
            sent = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "Sent"]
            out.append(int(sent[0]) if "tbf" in words and sent else -1)
        return out[0], out[1]

    def made(self) -> tuple[list[str], list[str]]:
        """(namespaces, root-namespace links) of this lab that exist now (tests, clean-up)."""
        spaces = _run([self.ip, "netns", "list"], check=False).split()
        links = _run([self.ip, "-o", "link", "show"], check=False)
        mine = f"{_PREFIX}{self.tag}"
        names = [x.split(":")[1].strip().split("@")[0] for x in links.splitlines() if ":" in x]
        return [s for s in spaces if s.startswith(mine)], [n for n in names if n.startswith(mine)]


def _free_blocks(count: int) -> list[ipaddress.IPv4Network]:
    """`count` /30 blocks of one 10.X.Y.0/24 that no address or specific route here overlaps.

    Routes shorter than /16 (a 10.0.0.0/8 towards a VPN, say) are not counted: a lab's own
    connected /30 is more specific, and only the root link's block lives in this namespace.
    """
    used = []
    for line in _run(["ip", "-o", "-4", "addr", "show"], check=False).splitlines():
        for word in line.split():
            if "/" in word and word[0].isdigit():
                used.append(ipaddress.ip_network(word, strict=False))
    for line in _run(["ip", "-4", "route", "show", "table", "all"], check=False).splitlines():
        word = line.split()[0] if line.split() else ""
        if word and word[0].isdigit():
            route = ipaddress.ip_network(word if "/" in word else f"{word}/32", strict=False)
            if route.prefixlen >= 16:
                used.append(route)
    for _ in range(64):
        base = ipaddress.ip_network(
            f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}.0/24"
        )
        if not any(base.overlaps(u) for u in used):
            blocks = list(base.subnets(new_prefix=30))
            if count > len(blocks):
                raise WanError(f"{count} links do not fit one /24 ({len(blocks)} /30 blocks)")
            return blocks[:count]
    raise WanError("no free 10.200-249.X.0/24 for the lab's links")


class Shaping:
    """How the local launcher runs its processes: on loopback, in a `WanLab`, or paced.

    The identity (no limit) unless `decoupled.wan_mbit` > 0: then a lab, or where the kernel
    cannot shape (`available`), the in-process pacer (`comm.faulty_link`, through each
    learner's control file) at the same rate. `line` says which, for the launcher's output.
    With `per_process` (`decoupled.wan_sites="process"`), every process of an island of
    `island_processes` is a site of its own.
    """

    def __init__(
        self,
        lab: WanLab | None = None,
        pacer_dir: str = "",
        rate_mbit: float = 0.0,
        why: str = "",
        island_processes: int = 1,
        per_process: bool = False,
    ):
        self.lab, self.pacer_dir, self.rate_mbit = lab, pacer_dir, rate_mbit
        self.island_processes = island_processes
        self.per_process = per_process and lab is not None and island_processes > 1
        # A learner's environment: where its link finds its cap (the pacer's control files).
        self.env = {faults.DIR_ENV: pacer_dir} if pacer_dir else {}
        if lab is not None:
            self.kind = "tbf"
            who = "each island process" if self.per_process else "each learner"
            self.line = (
                f"WAN: {who} in its own network namespace ({_PREFIX}{lab.tag}*) "
                f"behind tc tbf at {rate_mbit:g} Mbit/s each way"
            )
        elif pacer_dir:
            self.kind = "pacer"
            self.line = (
                f"WAN: kernel shaping unavailable ({why}); the learners' links are paced "
                f"in-process at {rate_mbit:g} Mbit/s each way instead"
            )
        else:
            self.kind, self.line = "none", ""

    def _site(self, learner: int, process: int) -> int:
        return learner * self.island_processes + process if self.per_process else learner

    @property
    def syncer_host(self) -> str:
        """The interface the syncers bind (all of their own namespace's, in a lab)."""
        return "0.0.0.0" if self.lab is not None else "127.0.0.1"

    def syncer(self, command: list[str]) -> list[str]:
        """A syncer's command, run where it belongs."""
        return self.lab.in_syncer(command) if self.lab is not None else command

    def learner(self, learner: int, command: list[str], process: int = 0) -> list[str]:
        """Process `process` of learner `learner`'s island, run where it belongs."""
        if self.lab is None:
            return command
        return self.lab.in_site(self._site(learner, process), command, self.per_process)

    def coordinator_host(self, learner: int) -> str:
        """Where the processes of learner `learner`'s island reach its coordinator (process 0)."""
        if not self.per_process:
            return "127.0.0.1"  # (the island's processes share one namespace)
        return self.lab.site_address(self._site(learner, 0))

    def address(self, ports: Sequence[int], learner: int | None = None, process: int = 0) -> str:
        """The syncer shards' addresses as a learner's process (None: the launcher) reaches them."""
        if self.lab is None:
            host = "127.0.0.1"
        else:
            host = self.lab.syncer_address(
                None if learner is None else self._site(learner, process)
            )
        return ",".join(f"{host}:{port}" for port in ports)

    def report(self) -> dict:
        """What the links carried, for the run's summary (`wan`): the kernel's byte counts."""
        if self.kind == "none":
            return {}
        out: dict = {"shaping": self.kind, "rate_mbit": self.rate_mbit}
        if self.lab is not None:
            sites = [self.lab.sent_bytes(i) for i in range(self.lab.num_sites)]
            out["sites"] = [{"up_bytes": up, "down_bytes": down} for up, down in sites]
        return out

    def close(self) -> None:
        """Removes the lab, if any."""
        if self.lab is not None:
            self.lab.close()


def shaping_for(
    rate_mbit: float,
    num_learners: int,
    pacer_dir: str,
    island_processes: int = 1,
    per_process: bool = False,
) -> Shaping:
    """The launcher's `Shaping` for `decoupled.wan_mbit` = `rate_mbit` (0: none).

    With the in-process fallback every learner's control file in `pacer_dir` caps its link
    (`bandwidth_mbps`); the caller points the learners' `DD_CHAOS_DIR` there. With
    `per_process` (sites per island process) there is no fallback: the pacer cannot slow an
    island's own collectives.

    Raises:
      WanError: `per_process` where the kernel cannot shape (the reason in the message).
    """
    if rate_mbit <= 0:
        return Shaping()
    per_process = per_process and island_processes > 1
    sites = num_learners * island_processes if per_process else num_learners
    ok, why = available()
    missing = [t for t in ("unshare", "hostname") if per_process and shutil.which(t) is None]
    if ok and missing:  # (util-linux and hostname: each process gets its own hostname)
        ok, why = False, f"{', '.join(missing)} not found (apt-get install util-linux hostname)"
    if ok:
        lab = WanLab(sites, rate_mbit, routed=per_process)
        try:
            lab.build()
            return Shaping(lab, rate_mbit=rate_mbit, island_processes=island_processes,
                           per_process=per_process)  # fmt: skip
        except WanError as error:  # e.g. no free block of addresses: pace instead, say why
            lab.close()
            if per_process:
                raise
            why = str(error)
        except BaseException:
            lab.close()
            raise
    if per_process:
        raise WanError(
            f"an island spanning sites needs kernel shaping ({why}): the in-process pacer "
            "cannot slow the island's own collectives"
        )
    for i in range(num_learners):
        faults.write_controls(pacer_dir, i, {"bandwidth_mbps": rate_mbit})
    return Shaping(pacer_dir=pacer_dir, rate_mbit=rate_mbit, why=why)
