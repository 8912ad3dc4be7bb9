"""The real-link harness (bench/link.py): a short run over a shaped link, and nothing left
behind (namespace, veth, qdisc) after a run that fails half way, raises, or is ended by
SIGTERM or SIGINT.

The full link rows are `bench/run.py --only freshness_link`; these stay at a few MiB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import link as link_harness  # noqa: E402
from bench.common import MiB  # noqa: E402

pytestmark = pytest.mark.skipif(link_harness.available() is not None, reason=str(link_harness.available()))


def _nothing_left(prefix: str, tag: str) -> None:
    left = link_harness.leftovers(prefix, tag)
    assert left == {"namespaces": [], "links": [], "qdiscs": []}, left


def _inside(link: link_harness.Link, host: str, *command: str) -> str:
    return subprocess.run([*link.exec_prefix(host), *command], capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(60)
def test_raw_fanout_over_a_shaped_link_then_nothing_left() -> None:
    """Namespaces, addresses and qdiscs as built; the raw fan-out crosses the link at about
    its rate (2 x 2 MiB leave the forwarder's 1 Gb/s link: >= 30 ms); then all is gone."""
    from bench.raw_fanout import raw_fanout

    with link_harness.Link(["trainer", "server", "collector0", "collector1"], rate="1gbit") as link:
        prefix, tag = link.prefix, link.tag
        made = set(link_harness.leftovers(prefix)["namespaces"])
        assert {link.netns(h) for h in link.hosts} | {prefix + "switch"} <= made
        assert f"inet {link.address('server')}/24" in _inside(link, "server", "ip", "-o", "addr")
        assert "tbf" in _inside(link, "collector0", "tc", "qdisc", "show")
        row = raw_fanout(2 * MiB, 2, link=link, idle=0.0, name="raw_fanout_1gbit")
        assert row.extra["bytes_arrived"], row.note
        assert min(row.extra["seconds"]) > 0.030, row.extra  # 4 MiB at 1 Gb/s: 33.5 ms
    _nothing_left(prefix, tag)


@pytest.mark.timeout(30)
def test_raising_inside_the_link_tears_it_down() -> None:
    """An exception once namespaces, veths, qdiscs and a process in a namespace exist."""
    link = link_harness.Link(["server", "collector0"], rate="10gbit")
    with pytest.raises(RuntimeError, match="half way"), link:
        sleeper = subprocess.Popen([*link.exec_prefix("server"), "sleep", "60"])
        assert link_harness.leftovers(link.prefix, link.tag)["namespaces"]
        raise RuntimeError("failing half way")
    assert sleeper.wait(5) == -signal.SIGKILL  # killed by the teardown: it held the namespace
    _nothing_left(link.prefix, link.tag)


@pytest.mark.timeout(30)
def test_a_failure_while_setting_up_tears_down_what_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The third host's veth cannot be made: the two namespaces and the switch already made go."""
    link = link_harness.Link(["trainer", "server", "collector0"], rate="1gbit")
    real_add_host = link._add_host

    def add_host(i: int, host: str, switch: str) -> None:
        if i == 2:
            raise link_harness.LinkError("no veth today")
        real_add_host(i, host, switch)

    monkeypatch.setattr(link, "_add_host", add_host)
    with pytest.raises(link_harness.LinkError, match="no veth today"):
        link.open()
    _nothing_left(link.prefix, link.tag)


# bench.link's command line, as `python -m bench.link` runs it, in a process started with SIGINT
# ignored (as a shell's background job is): Ctrl-C raises no KeyboardInterrupt there.
SIGINT_IGNORED = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "runpy.run_module('bench.link', run_name='__main__')"
)


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("signum", "ignored"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT", "SIGINT, ignored when it started"],
)
def test_a_signal_tears_the_link_down(signum: int, ignored: bool) -> None:
    """`python -m bench.link --hold 30` (a link, a process sleeping in a namespace) signalled
    once ready: it exits at once, and its namespaces, veths and qdiscs are gone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, *(["-c", SIGINT_IGNORED] if ignored else ["-m", "bench.link"]), "--hold", "30"]
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        assert run.stdout is not None and run.stderr is not None
        _, prefix, _, tag = run.stdout.readline().split()
        ready = run.stdout.readline()
        assert ready.startswith("ready"), (ready, run.stderr.read() if run.poll() is not None else "")
        assert link_harness.leftovers(prefix, tag)["namespaces"]
        started = time.monotonic()
        run.send_signal(signum)
        code = run.wait(20)
        stderr = run.stderr.read()
    assert time.monotonic() - started < 10
    assert code != 0, f"the run ended normally instead of being interrupted: {stderr}"
    _nothing_left(prefix, tag)
