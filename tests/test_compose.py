"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine.

The compose file is the single source of truth for how the services run: these tests read
each service's command and environment from it (interpolating ``${VAR:-default}`` the way
compose does, from this process's environment), map what only exists inside containers to
this machine (service host names -> 127.0.0.1, container ports -> free ports, named volumes ->
temp dirs, `python` -> this interpreter, console scripts -> this venv's) and start them as
processes on loopback. The Dockerfile's CMD and HEALTHCHECK run the same way.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from importlib.metadata import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
BIN = Path(sys.executable).parent
_VARIABLE = re.compile(
    r"\$(?:\$"  # $$
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?-)?(?P<default>[^}]*)\}"  # ${VAR}, ${VAR:-default}
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"  # $VAR
)


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, default = match.group("op"), match.group("default")
        if op is None and default:
            raise ValueError(f"unsupported interpolation {match.group(0)!r} in {value!r}")
        current = env.get(name)
        if op == ":-" and not current:
            return default
        if op == "-" and current is None:
            return default
        return current or ""

    return _VARIABLE.sub(replace, value)


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: interpolate(str(value), os.environ) for key, value in env.items()}


def volume_mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """{volume name: container path} of a service's named-volume mounts."""
    mounts = {}
    for item in service.get("volumes", []):
        source, target = item.split(":")[:2]
        mounts[source] = target
    return mounts


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#") and not current:
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            joined.append((word.upper(), rest.strip()))
        current = ""
    return joined


def exec_form(arguments: str) -> list[str]:
    command = json.loads(arguments)
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), arguments
    return command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loopback:
    """Maps what a service sees inside its container onto this machine."""

    def __init__(self, compose: Mapping[str, Any], tmp_path: Path) -> None:
        services = compose["services"]
        self.hosts = set(services)
        ports = {str(p).split(":")[-1] for s in services.values() for p in s.get("expose", [])}
        self.ports = {port: str(free_port()) for port in ports}
        self.volumes = {name: tmp_path / "volumes" / name for name in compose.get("volumes", {})}
        for path in self.volumes.values():
            path.mkdir(parents=True)

    def value(self, text: str, mounts: Mapping[str, str]) -> str:
        def address(match: re.Match[str]) -> str:
            port = match.group(2)
            return f"127.0.0.1:{self.ports.get(port, port)}"

        hosts = "|".join(map(re.escape, sorted(self.hosts | {"127.0.0.1", "localhost", "0.0.0.0"})))
        text = re.sub(rf"\b({hosts}):(\d+)\b", address, text)
        if text in self.ports:
            return self.ports[text]
        if text == "0.0.0.0":
            return "127.0.0.1"
        for volume, target in mounts.items():
            if text == target or text.startswith(target + "/"):
                return str(self.volumes[volume]) + text[len(target) :]
        return text

    def command(self, command: list[str], mounts: Mapping[str, str] | None = None) -> list[str]:
        mounts = mounts or {}
        program = {"python": sys.executable}.get(command[0]) or str(BIN / command[0])
        assert Path(program).exists(), f"{command[0]!r}: no such console script in {BIN}"
        return [program, *(self.value(arg, mounts) for arg in command[1:])]

    def environment(self, service: Mapping[str, Any]) -> dict[str, str]:
        mounts = volume_mounts(service)
        return {key: self.value(value, mounts) for key, value in environment_of(service).items()}


def healthcheck() -> list[str]:
    [(_, arguments)] = [(i, a) for i, a in dockerfile_instructions() if i == "HEALTHCHECK"]
    command = exec_form(arguments[arguments.index("CMD ") + 4 :])
    return command


def start(command: list[str], env: Mapping[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    with open(log or os.devnull, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )


def wait_healthy(command: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(command, cwd=REPO, capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, f"not healthy within {timeout}s"
        time.sleep(0.2)


def stop(process: subprocess.Popen, timeout: float = 15.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@pytest.fixture
def compose() -> dict[str, Any]:
    return load_compose()


def help_texts(services: Mapping[str, Any], tmp_path: Path) -> dict[str, str]:
    """`--help` of each service's program (the command up to its first option), run in parallel."""
    loopback = Loopback(load_compose(), tmp_path)
    running = {}
    for name, service in services.items():
        command = service["command"]
        program = command[: next((i for i, arg in enumerate(command) if arg.startswith("--")), len(command))]
        running[name] = subprocess.Popen(
            [*loopback.command(program), "--help"], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
    texts = {name: process.communicate(timeout=60)[0] for name, process in running.items()}  # waits for all
    assert all(process.returncode == 0 for process in running.values()), texts
    return texts


def test_compose_services_settings_and_volumes(compose: dict[str, Any], tmp_path: Path):
    services = compose["services"]
    assert set(services) == {"weightserver", "trainer", "collector"}
    replicas = services["collector"]["deploy"]["replicas"]
    assert replicas == 2
    # the trainer waits for exactly as many collector reports as compose starts collectors
    assert int(environment_of(services["trainer"])["DEMO_COLLECTORS"]) == replicas
    helps = help_texts(services, tmp_path)
    for name, service in services.items():
        # every variable a service gets is one its program reads (its --help names it)
        unread = {variable for variable in environment_of(service) if f"${variable}" not in helps[name]}
        assert not unread, f"{name} sets variables its program does not read: {unread}"
        for volume in volume_mounts(service):
            assert volume in compose["volumes"], f"{name} mounts undeclared volume {volume}"
    assert volume_mounts(services["weightserver"]) == {"weights": "/data"}
    assert "--data-dir" in services["weightserver"]["command"]
    assert volume_mounts(services["trainer"]) == volume_mounts(services["collector"]) == {"spool": "/spool"}
    for name in ("trainer", "collector"):
        assert services[name]["depends_on"]["weightserver"]["condition"] == "service_healthy"
    # the demo's duration comes from the environment, so a run (or this test) can shorten it
    assert "${DEMO_SECONDS" in COMPOSE.read_text()


def test_docker_compose_validates_the_file():
    """`docker-compose config` (the Debian package, what CI runs) or `docker compose config`."""
    if shutil.which("docker-compose"):
        command = ["docker-compose"]
    elif subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command = ["docker", "compose"]
    elif os.environ.get("WEIGHTSERVER_REQUIRE_DOCKER_COMPOSE") == "1":  # CI: never pass by skipping
        pytest.fail("WEIGHTSERVER_REQUIRE_DOCKER_COMPOSE=1 but docker-compose is not installed")
    else:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed (apt install docker-compose)")
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--services"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["collector", "trainer", "weightserver"]


def test_dockerfile_copies_what_exists_and_installs_cpu_torch():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    workdir = [a for i, a in instructions if i == "WORKDIR"][-1]
    copied = []
    for instruction, arguments in instructions:
        if instruction == "COPY":
            sources = arguments.split()[:-1]
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                copied.append(source.rstrip("/"))
    assert "demo" in copied and workdir == "/app"  # `python -m demo.trainer` runs from /app
    ignore = (REPO / ".dockerignore").read_text().split()
    assert all(f"!{source}" in ignore or f"!{source}/" in ignore for source in copied), "excluded from the context"

    extras = metadata("weightserver").get_all("Provides-Extra") or []
    runs = [a for i, a in instructions if i == "RUN"]
    for run in runs:
        for step in (shlex.split(part) for part in run.split("&&")):
            if step[0] == "pip":
                assert step[1] == "install" and "-c" in step and (REPO / step[step.index("-c") + 1]).exists()
                assert step[step.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
                for target in step:
                    if target.startswith(".["):
                        assert set(target[2:-1].split(",")) <= set(extras), target
            else:  # base-image tools
                assert step[0] in {"useradd", "mkdir", "chown"}, step
                assert shutil.which(step[0], path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"), step[0]
    user = [a for i, a in instructions if i == "USER"][-1]
    assert user not in ("root", "0") and any(f"useradd --create-home --uid 10001 {user}" in r for r in runs)
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_dockerfile_cmd_serves_and_healthcheck_reports_it(compose: dict[str, Any], tmp_path: Path):
    """The image's CMD starts a server; its HEALTHCHECK passes against it and fails without."""
    loopback = Loopback(compose, tmp_path)
    cmd = exec_form([a for i, a in dockerfile_instructions() if i == "CMD"][-1])
    check = loopback.command(healthcheck())
    mounts = volume_mounts(compose["services"]["weightserver"])  # where compose mounts the image's /data
    server = start(loopback.command(cmd, mounts), log=tmp_path / "server.log")
    try:
        wait_healthy(check)
    finally:
        assert stop(server) == 0, (tmp_path / "server.log").read_text()
    assert subprocess.run(check, cwd=REPO, capture_output=True, timeout=30).returncode != 0


def processes(compose: dict[str, Any], loopback: Loopback, tmp_path: Path) -> Iterator[subprocess.Popen]:
    services = compose["services"]
    for name in ("trainer", "collector"):
        service = services[name]
        for replica in range(service.get("deploy", {}).get("replicas", 1)):
            command = loopback.command(service["command"], volume_mounts(service))
            yield start(command, loopback.environment(service), log=tmp_path / f"{name}-{replica}.log")


@pytest.mark.slow
def test_compose_services_run_on_loopback(compose: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Start exactly what compose would start; the collectors end on the trainer's last version."""
    for name, value in {
        "DEMO_SECONDS": "6",
        "DEMO_FRAMES_PER_BATCH": "50",
        "DEMO_PUBLISH_EVERY": "10",
        "DEMO_WARMUP_FRAMES": "200",
        "DEMO_RANDOM_FRAMES": "100",
    }.items():
        monkeypatch.setenv(name, value)  # through the ${...:-default} entries of the compose file
    loopback = Loopback(compose, tmp_path)
    server_service = compose["services"]["weightserver"]
    server = start(
        loopback.command(server_service["command"], volume_mounts(server_service)),
        loopback.environment(server_service),
        log=tmp_path / "server.log",
    )
    started: list[subprocess.Popen] = []
    try:
        wait_healthy(loopback.command(healthcheck()))
        started = list(processes(compose, loopback, tmp_path))
        codes = [p.wait(timeout=90) for p in started]
    finally:
        for process in started:
            if process.poll() is None:
                stop(process)
        server_code = stop(server)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert codes == [0] * len(started) and server_code == 0, logs
    spool = tmp_path / "volumes" / "spool"
    summary = json.loads((spool / "summary.json").read_text())
    assert len(summary["collectors"]) == compose["services"]["collector"]["deploy"]["replicas"], logs
    for report in summary["collectors"].values():
        assert report["final_version"] == summary["final_version"], report
        assert report["versions_applied"] >= 2, report
    assert summary["spool_empty"] and summary["frames_consumed"] == summary["frames_collected"] > 0
    # the server kept the versions in its data-dir volume
    assert (tmp_path / "volumes" / "weights" / "policy").is_dir()
