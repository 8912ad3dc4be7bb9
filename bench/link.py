"""A real-link harness: hosts in network namespaces of their own, joined through a bridge by
veth pairs shaped with `tc`, for the link rows (`freshness_link`, `raw_fanout` on the link).

    with Link(["trainer", "server", "collector0", "collector1"], rate="1gbit", delay_ms=0.2) as link:
        subprocess.run([*link.exec_prefix("server"), sys.executable, ...])   # runs in its namespace
        link.address("server")                                              # '10.231.0.2'

Topology: a switch namespace (`<prefix>switch`) holds a bridge; every host gets a namespace
(`<prefix><host>`) and a veth pair, one end (`eth`, 10.231.0.N/24) in the host's namespace, the
other a port of the bridge. Each direction of each host's link is shaped to `rate` (`tbf` on
the host's end and on the bridge port); the host's end also delays what it sends by
`delay_ms` (`netem` under the `tbf`), so a packet from one host to another takes `delay_ms`
more one way. A kernel without `sch_netem` gets the rate only: `delay_applied` says so.

Nothing is created in the root namespace: namespaces, veths and qdiscs live in namespaces the
harness made, under names carrying a per-run prefix (`wslink-<pid>-<n>-`; interfaces `wl<pid
hex>-<n hex>`...). Teardown (`close()`, idempotent) kills every process left in those
namespaces and deletes them, which destroys the veths and their qdiscs with them. It runs on
leaving the `with` block whatever ends it (an exception, a failure half way through setting
up), on SIGINT and SIGTERM (each turned into SystemExit while a Link is open, so the block
unwinds: also in a process started with SIGINT ignored, as a shell's background job or a
pytest-xdist worker's child is, where Ctrl-C would raise no KeyboardInterrupt) and at interpreter
exit (atexit) for a Link never closed. SIGKILL cannot be caught: the leftovers of a killed run
are found with `leftovers(prefix)`, and `python -m bench.link --clean` deletes every `wslink-` namespace.

Needs root and `ip netns` (iproute2). Processes run inside a namespace through `ip netns exec
NAME ...` (`exec_prefix`), multiprocessing children through `spawning_in(host)`, which makes
the "spawn" start method launch its interpreter the same way.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

SUBNET = "10.231.0"  # /24 inside the run's own namespaces: no other namespace sees it
NAMESPACE_PREFIX = "wslink-"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
_runs = itertools.count()
_open: set[Link] = set()
_lock = threading.Lock()
_previous_handlers: dict[int, object] = {}  # signal -> its handler before the first Link opened
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LinkError(RuntimeError):
    """A command of the harness failed (the message has the command and its stderr)."""


def available() -> str | None:
    """None when this process can build a link; otherwise why not (for skips and n/a rows)."""
    if os.geteuid() != 0:
        return "the link harness needs root (ip netns add, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns is unavailable: {probe.stderr.strip()}"
    return None


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9, '10gbit' -> 1e10, '500mbit' -> 5e8 (tc's units, decimal)."""
    match = _RATE.match(rate.strip())
    if not match:
        raise ValueError(f"not a rate: {rate!r} (use e.g. 1gbit, 10gbit, 500mbit)")
    return float(match.group(1)) * _SCALE[match.group(2).lower()]


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LinkError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


class Link:
    """Hosts in namespaces of their own behind one bridge, each link shaped to `rate` and
    `delay_ms` one way (see the module docstring). `rate=None`: unshaped veths."""

    def __init__(self, hosts: Sequence[str], rate: str | None = "1gbit", delay_ms: float = 0.2) -> None:
        if len(set(hosts)) != len(hosts) or not 0 < len(hosts) <= 250 or "switch" in hosts:
            raise ValueError(f"hosts must be 1-250 distinct names other than 'switch', got {list(hosts)}")
        if not all(re.fullmatch(r"[a-z][a-z0-9_]{0,30}", host) for host in hosts):
            raise ValueError(f"host names are lowercase letters, digits and _: {list(hosts)}")
        if rate is not None:
            rate_bits(rate)  # checked before anything is created
        run = next(_runs)
        self.hosts = list(hosts)
        self.rate = rate
        self.delay_ms = delay_ms
        self.prefix = f"{NAMESPACE_PREFIX}{os.getpid()}-{run}-"
        self.tag = f"wl{os.getpid():x}-{run:x}"  # interface names (15 characters at most)
        self.delay_applied = False
        self._namespaces: list[str] = []
        self._dir: Path | None = None
        self._closed = False

    # ------------------------------------------------------------------ names
    def netns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a command in `host`'s namespace."""
        return ["ip", "netns", "exec", self.netns(host)]

    def python(self, host: str) -> str:
        """An executable that runs this interpreter in `host`'s namespace (for `spawning_in`)."""
        assert self._dir is not None, "the link is not set up"
        return str(self._dir / f"python-{self.hosts.index(host)}")

    @contextmanager
    def spawning_in(self, host: str) -> Iterator[None]:
        """Multiprocessing "spawn" children started inside this block run in `host`'s namespace
        (their interpreter is launched through `ip netns exec`)."""
        from multiprocessing import resource_tracker, spawn

        resource_tracker.ensure_running()  # started here, in the root namespace, not in a host's
        before = spawn.get_executable()
        spawn.set_executable(self.python(host))
        try:
            yield
        finally:
            spawn.set_executable(before)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> Link:
        """Create the namespaces, bridge, veths and qdiscs; on any failure, tear down and raise."""
        _register(self)
        try:
            self._dir = Path(tempfile.mkdtemp(prefix=self.prefix))
            switch = self._add_namespace(self.prefix + "switch")
            _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                self._add_host(i, host, switch)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> str:
        self._namespaces.append(name)  # before creating it: a half-made one is deleted too
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _add_host(self, i: int, host: str, switch: str) -> None:
        namespace = self._add_namespace(self.netns(host))
        port, eth = f"{self.tag}p{i}", f"{self.tag}h{i}"
        _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", eth, "netns", namespace)
        _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", eth)
        _run("ip", "-n", namespace, "link", "set", eth, "up")
        if self.rate is not None:
            self._shape(switch, port, delay=False)
            self._shape(namespace, eth, delay=self.delay_ms > 0)
        script = Path(self.python(host))
        script.write_text(f'#!/bin/sh\nexec ip netns exec {namespace} "{sys.executable}" "$@"\n')
        script.chmod(0o755)

    def _shape(self, namespace: str, device: str, delay: bool) -> None:
        """`tbf` at `rate` on the device's egress (burst: 1 ms of bytes, at least 128 KiB, so a
        64 KiB GSO packet passes whole); under it `netem delay` when asked and available."""
        assert self.rate is not None
        burst = max(128 * 1024, int(rate_bits(self.rate) / 8 / 1000))
        tbf = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "tbf"]
        _run(*tbf, "rate", self.rate, "burst", str(burst), "latency", "50ms")
        if delay:
            netem = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "netem"]
            done = _run(*netem, "delay", f"{self.delay_ms}ms", "limit", "100000", check=False)
            if done.returncode == 0:
                self.delay_applied = True
            elif "unknown" not in done.stderr.lower():
                raise LinkError(f"{' '.join(netem)} failed: {done.stderr.strip()}")

    def describe(self) -> str:
        """One line for a row's note: the shaping as built."""
        if self.rate is None:
            return "unshaped veths through a bridge"
        if self.delay_ms <= 0:
            return f"{self.rate} per direction, no added delay"
        delay = f"{self.delay_ms:g} ms one way" if self.delay_applied else "NO added delay (kernel lacks sch_netem)"
        return f"{self.rate} per direction (tbf), {delay}"

    def close(self) -> None:
        """Kill what runs in the run's namespaces and delete them (with their veths and
        qdiscs). Idempotent; SIGINT and SIGTERM wait until it is done; errors are collected
        and raised at the end, after everything was tried."""
        if self._closed:
            return
        blocked = {signal.SIGINT, signal.SIGTERM}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        errors: list[str] = []
        try:
            self._closed = True
            names = set(self._namespaces) | set(leftovers(self.prefix, self.tag)["namespaces"])
            for name in names:
                _kill_processes(name)
            for name in names:
                done = _run("ip", "netns", "del", name, check=False)
                if done.returncode != 0 and name in _namespaces():
                    errors.append(f"ip netns del {name}: {done.stderr.strip()}")
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            left = leftovers(self.prefix, self.tag)
            if any(left.values()):
                errors.append(f"left behind: {left}")
        finally:
            _unregister(self)
            if in_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        if errors:
            raise LinkError("; ".join(errors))

    def __enter__(self) -> Link:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _namespaces() -> list[str]:
    listed = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_processes(namespace: str) -> None:
    """SIGKILL every process in `namespace` and wait (2 s at most) until they are gone: a
    namespace with a process in it outlives `ip netns del`, and its veths with it."""
    pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        time.sleep(0.01)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def leftovers(prefix: str = NAMESPACE_PREFIX, tag: str = "wl") -> dict[str, list[str]]:
    """What exists of a run: namespaces named `prefix`..., and in the root namespace links
    and qdiscs on devices named `tag`... (the harness makes none there; a test checks)."""
    links = _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    qdiscs = _run("tc", "qdisc", "show", check=False).stdout.splitlines()
    return {
        "namespaces": [name for name in _namespaces() if name.startswith(prefix)],
        "links": [line for line in links if re.search(rf":\s{re.escape(tag)}", line)],
        "qdiscs": [line for line in qdiscs if re.search(rf"\sdev {re.escape(tag)}", line)],
    }


# ---------------------------------------------------------------------- signals, atexit
def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with` blocks: their teardown runs


def _register(link: Link) -> None:
    with _lock:
        if not _open and threading.current_thread() is threading.main_thread():
            _previous_handlers.update((signum, signal.signal(signum, _on_signal)) for signum in _SIGNALS)
        _open.add(link)


def _unregister(link: Link) -> None:
    with _lock:
        _open.discard(link)
        if not _open and _previous_handlers and threading.current_thread() is threading.main_thread():
            for signum, handler in _previous_handlers.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
            _previous_handlers.clear()


@atexit.register
def _close_all() -> None:
    for link in list(_open):
        try:
            link.close()
        except Exception as exc:
            print(f"link teardown at exit: {exc}", file=sys.stderr)


# ---------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """`--clean`: delete every `wslink-` namespace (a SIGKILLed run's); otherwise build a link
    of `--hosts`, print its prefix and `ready`, hold it `--hold` seconds, tear it down (the
    teardown test signals this)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--clean", action="store_true")
    parser.add_argument("--hosts", default="trainer,server,collector0,collector1")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay-ms", type=float, default=0.2)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--fail", action="store_true", help="raise once the link is up")
    args = parser.parse_args(argv)
    if args.clean:
        for name in leftovers()["namespaces"]:
            _kill_processes(name)
            _run("ip", "netns", "del", name, check=False)
            print(f"deleted {name}")
        return 0
    with Link(args.hosts.split(","), rate=args.rate, delay_ms=args.delay_ms) as link:
        print(f"prefix {link.prefix} tag {link.tag}", flush=True)
        sleeper = subprocess.Popen([*link.exec_prefix(link.hosts[0]), "sleep", "600"])  # a process to kill
        print(f"ready {link.describe()} sleeper {sleeper.pid}", flush=True)
        if args.fail:
            raise RuntimeError("failing on purpose with the link up")
        time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
