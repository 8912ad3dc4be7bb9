"""docker/compose.yaml, docker/compose.tree.yaml and docker/Dockerfile, checked without a
Docker engine.

A compose file is the single source of truth for how its services run: these tests read each
service's command and environment from it (interpolating ``${VAR:-default}`` the way compose
does, from this process's environment), map what only exists inside containers to this machine
(service host names -> 127.0.0.1, each service's container ports -> free ports of its own, named
volumes -> temp dirs, `python` -> this interpreter, console scripts -> this venv's) and start
them as processes on loopback, in `depends_on` order, waiting for a `service_healthy`
dependency's HEALTHCHECK as compose does. The Dockerfile's CMD and HEALTHCHECK run the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from waiting import wait_equal

from weightserver.cli import build_parser, server_config

pytest.importorskip("torchrl", reason="torchrl is not installed: pip install -e '.[torchrl]'")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
COMPOSE_TREE = REPO / "docker" / "compose.tree.yaml"
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


def load_compose(path: Path = COMPOSE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


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


def is_server(service: Mapping[str, Any]) -> bool:
    """A service that runs until stopped and reports health (the image's HEALTHCHECK); the
    others (trainer, collectors) disable it and run to completion."""
    return not (service.get("healthcheck") or {}).get("disable", False)


def replicas(service: Mapping[str, Any]) -> int:
    return service.get("deploy", {}).get("replicas", 1)


def serve_options(command: list[str]) -> Any:
    """A `weightserver serve ...` command parsed by the real parser, as its ServerConfig."""
    assert command[:2] == ["weightserver", "serve"], command
    return server_config(build_parser().parse_args(command[1:]))


def start_order(services: Mapping[str, Any]) -> list[str]:
    """Service names, each after every service it depends on (as compose starts them)."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
        if name not in order:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency, (*path, name))
            order.append(name)

    for name in services:
        visit(name, ())
    return order


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


def free_ports(count: int) -> list[str]:
    """`count` distinct free loopback ports: all held until all are chosen (a port released at
    once can come back from the next bind; two services were once given the same one)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [str(s.getsockname()[1]) for s in sockets]


class Loopback:
    """Maps what a service sees inside its container onto this machine: each service's exposed
    ports get free ports of their own (the primary and the relays all listen on 50051 inside
    their containers), and its own address (127.0.0.1, localhost, 0.0.0.0) means its ports."""

    def __init__(self, compose: Mapping[str, Any], tmp_path: Path) -> None:
        self.services = compose["services"]
        exposed = [
            (name, str(port).split(":")[-1]) for name, s in self.services.items() for port in s.get("expose", [])
        ]
        self.ports = dict(zip(exposed, free_ports(len(exposed)), strict=True))
        self.volumes = {name: tmp_path / "volumes" / name for name in compose.get("volumes", {})}
        for path in self.volumes.values():
            path.mkdir(parents=True)

    def port(self, service: str, port: int | str) -> int:
        """The loopback port of `service`'s container port."""
        return int(self.ports[(service, str(port))])

    def value(self, text: str, service: str) -> str:
        def address(match: re.Match[str]) -> str:
            host, port = match.group(1), match.group(2)
            owner = host if host in self.services else service
            return f"127.0.0.1:{self.ports.get((owner, port), port)}"

        hosts = "|".join(map(re.escape, sorted({*self.services, "127.0.0.1", "localhost", "0.0.0.0"})))
        text = re.sub(rf"\b({hosts}):(\d+)\b", address, text)
        if (service, text) in self.ports:
            return self.ports[(service, text)]
        if text == "0.0.0.0":
            return "127.0.0.1"
        for volume, target in volume_mounts(self.services[service]).items():
            if text == target or text.startswith(target + "/"):
                return str(self.volumes[volume]) + text[len(target) :]
        return text

    def command(self, command: list[str], service: str) -> list[str]:
        """`command` as `service` runs it, mapped onto this machine."""
        program = {"python": sys.executable}.get(command[0]) or str(BIN / command[0])
        assert Path(program).exists(), f"{command[0]!r}: no such console script in {BIN}"
        return [program, *(self.value(arg, service) for arg in command[1:])]

    def environment(self, service: str) -> dict[str, str]:
        return {key: self.value(value, service) for key, value in environment_of(self.services[service]).items()}


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
    wait_equal(
        lambda: subprocess.run(command, cwd=REPO, capture_output=True).returncode,
        0,
        timeout=timeout,
        what=f"{' '.join(command)} to exit 0 (healthy)",
    )


def stop(process: subprocess.Popen, timeout: float = 15.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@contextmanager
def running(
    compose: Mapping[str, Any], loopback: Loopback, tmp_path: Path
) -> Iterator[dict[str, list[subprocess.Popen]]]:
    """Start every service (each replica) as compose would, in depends_on order, waiting for a
    dependency's HEALTHCHECK where the condition is service_healthy; yield {service: its
    processes}. Whatever still runs at the end is stopped, last started first."""
    services = compose["services"]
    started: dict[str, list[subprocess.Popen]] = {}
    healthy: set[str] = set()
    try:
        for name in start_order(services):
            for dependency, condition in services[name].get("depends_on", {}).items():
                if condition.get("condition") == "service_healthy" and dependency not in healthy:
                    wait_healthy(loopback.command(healthcheck(), dependency))
                    healthy.add(dependency)
            service = services[name]
            started[name] = [
                start(
                    loopback.command(service["command"], name),
                    loopback.environment(name),
                    log=tmp_path / f"{name}-{replica}.log",
                )
                for replica in range(replicas(service))
            ]
        yield started
    finally:
        # Every process is stopped even when one does not stop in time (that one is killed and its
        # failure raised after): a raise part-way once left the servers running after the test.
        late = []
        for processes in reversed(list(started.values())):
            for process in processes:
                try:
                    stop(process)
                except subprocess.TimeoutExpired as exc:
                    late.append(exc)
        if late:
            raise late[0]


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))


@pytest.fixture
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture
def tree() -> dict[str, Any]:
    return load_compose(COMPOSE_TREE)


def help_texts(compose: Mapping[str, Any], tmp_path: Path) -> dict[str, str]:
    """`--help` of each service's program (the command up to its first option), each program
    run once, in parallel."""
    loopback = Loopback(compose, tmp_path)
    programs, running = {}, {}
    for name, service in compose["services"].items():
        command = service["command"]
        programs[name] = tuple(command[: next((i for i, a in enumerate(command) if a.startswith("--")), len(command))])
        if programs[name] not in running:
            running[programs[name]] = subprocess.Popen(
                [*loopback.command(list(programs[name]), name), "--help"], cwd=REPO, stdout=subprocess.PIPE, text=True
            )
    texts = {program: process.communicate(timeout=60)[0] for program, process in running.items()}  # waits for all
    assert all(process.returncode == 0 for process in running.values()), texts
    return {name: texts[program] for name, program in programs.items()}


def check_variables_and_volumes(compose: Mapping[str, Any], tmp_path: Path) -> None:
    helps = help_texts(compose, tmp_path)
    for name, service in compose["services"].items():
        # every variable a service gets is one its program reads (its --help names it)
        unread = {variable for variable in environment_of(service) if f"${variable}" not in helps[name]}
        assert not unread, f"{name} sets variables its program does not read: {unread}"
        for volume in volume_mounts(service):
            assert volume in compose["volumes"], f"{name} mounts undeclared volume {volume}"
        if service["command"][:2] == ["weightserver", "serve"]:
            serve_options(service["command"])  # accepted by `weightserver serve`, as a ServerConfig


def test_compose_services_settings_and_volumes(compose: dict[str, Any], tmp_path: Path):
    services = compose["services"]
    assert set(services) == {"weightserver", "trainer", "collector"}
    assert replicas(services["collector"]) == 2
    # the trainer waits for exactly as many collector reports as compose starts collectors
    assert int(environment_of(services["trainer"])["DEMO_COLLECTORS"]) == replicas(services["collector"])
    check_variables_and_volumes(compose, tmp_path)
    assert volume_mounts(services["weightserver"]) == {"weights": "/data"}
    assert "--data-dir" in services["weightserver"]["command"]
    assert str(serve_options(services["weightserver"]["command"]).metrics_port) in services["weightserver"]["expose"]
    assert volume_mounts(services["trainer"]) == volume_mounts(services["collector"]) == {"spool": "/spool"}
    for name in ("trainer", "collector"):
        assert services[name]["depends_on"]["weightserver"]["condition"] == "service_healthy"
    # the demo's duration comes from the environment, so a run (or this test) can shorten it
    assert "${DEMO_SECONDS" in COMPOSE.read_text()


@pytest.mark.parametrize(
    ("path", "services"),
    [
        (COMPOSE, ["collector", "trainer", "weightserver"]),
        (COMPOSE_TREE, ["collector-a", "collector-b", "relay-a", "relay-b", "trainer", "weightserver"]),
    ],
    ids=["compose", "tree"],
)
def test_docker_compose_validates_the_file(path: Path, services: list[str]):
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
        [*command, "-f", str(path), "config", "--services"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == services


def dockerfile_args() -> dict[str, str]:
    """{name: default} of the Dockerfile's ARGs."""
    return dict(a.partition("=")[::2] for i, a in dockerfile_instructions() if i == "ARG")


def shell_words(text: str, env: Mapping[str, str]) -> list[str]:
    """`text` split into words the way the build's /bin/sh does, with `env` as the build args
    (parameter expansion only: `set --` runs nothing)."""
    result = subprocess.run(
        ["sh", "-c", f'set -- {text}; printf "%s\\0" "$@"'], env=dict(env), capture_output=True, text=True, check=True
    )
    return result.stdout.split("\0")[:-1]


def test_dockerfile_copies_what_exists_and_installs_cpu_torch():
    instructions = dockerfile_instructions()
    args = dockerfile_args()
    # python:3.11-slim and the PyTorch CPU index unless the build args say otherwise
    assert instructions[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    workdir = [a for i, a in instructions if i == "WORKDIR"][-1]
    copied = []
    for instruction, arguments in instructions:
        if instruction == "COPY":
            sources = arguments.split()[:-1]
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                copied.append(source.rstrip("/"))
    ignore = (REPO / ".dockerignore").read_text().split()
    context = [entry[1:].rstrip("/") for entry in ignore if entry.startswith("!")]  # `*` and these only
    assert all(source in context for source in copied if source != "."), "excluded from the context"
    in_image = {path for source in copied for path in (context if source == "." else [source])}
    assert {"demo", "weightserver", "client", "pyproject.toml"} <= in_image  # (`COPY . ./`: the context)
    assert workdir == "/app"  # `python -m demo.trainer` runs from /app

    extras = metadata("weightserver").get_all("Provides-Extra") or []
    [pin] = re.findall(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    runs = [a for i, a in instructions if i == "RUN"]
    torch_installs = []
    for index_url in (args["TORCH_INDEX_URL"], ""):  # the default, and the air-gapped path's
        for run in runs:
            for step in (shell_words(part, {"TORCH_INDEX_URL": index_url}) for part in run.split("&&")):
                if step[0] == "pip":
                    assert step[1] == "install" and "-c" in step and (REPO / step[step.index("-c") + 1]).exists()
                    if any(target.startswith("torch") for target in step):
                        # the CPU build of the pinned version, or the build fails: never PyPI's CUDA torch
                        assert f"torch=={pin}+cpu" in step, step
                        extra = step[step.index("--extra-index-url") + 1] if "--extra-index-url" in step else ""
                        torch_installs.append(extra)
                    else:  # torch is installed by then: the rest comes from PyPI alone
                        assert "--extra-index-url" not in step, step
                    for target in step:
                        if target.startswith(".["):
                            assert set(target[2:-1].split(",")) <= set(extras), target
                else:  # base-image tools
                    assert step[0] in {"useradd", "mkdir", "chown"}, step
                    assert shutil.which(step[0], path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"), step[0]
    assert torch_installs == [args["TORCH_INDEX_URL"], ""]
    user = [a for i, a in instructions if i == "USER"][-1]
    assert user not in ("root", "0") and any(f"useradd --create-home --uid 10001 {user}" in r for r in runs)


def test_compose_builds_the_image_once_with_the_dockerfiles_args(compose: dict[str, Any], tree: dict[str, Any]):
    """Only the weightserver service builds (`up --build` would build once per service with a
    build section); the others run the image it tags. Its build args are the Dockerfile's ARGs,
    with the same defaults; an empty TORCH_INDEX_URL stays empty (the air-gapped path)."""
    for services in (compose["services"], tree["services"]):
        assert [name for name, service in services.items() if "build" in service] == ["weightserver"]
        assert {service["image"] for service in services.values()} == {"weightserver-demo:latest"}
        build_args = services["weightserver"]["build"]["args"]
        assert set(build_args) == set(dockerfile_args())
        defaults = {name: interpolate(value, {}) for name, value in build_args.items()}
        assert defaults == dockerfile_args()
        assert interpolate(build_args["TORCH_INDEX_URL"], {"TORCH_INDEX_URL": ""}) == ""
    # the project name: docker/.env (1.29 rejects a top-level name:), not the folder's name
    assert "name" not in compose and "name" not in tree
    assert "COMPOSE_PROJECT_NAME=weightserver-demo" in (REPO / "docker" / ".env").read_text().splitlines()


def test_dockerfile_cmd_serves_and_healthcheck_reports_it(compose: dict[str, Any], tmp_path: Path):
    """The image's CMD starts a server; its HEALTHCHECK passes against it and fails without."""
    loopback = Loopback(compose, tmp_path)
    cmd = exec_form([a for i, a in dockerfile_instructions() if i == "CMD"][-1])
    # as the weightserver service, where compose mounts the image's /data
    check = loopback.command(healthcheck(), "weightserver")
    server = start(loopback.command(cmd, "weightserver"), log=tmp_path / "server.log")
    try:
        wait_healthy(check)
    finally:
        assert stop(server) == 0, (tmp_path / "server.log").read_text()
    assert subprocess.run(check, cwd=REPO, capture_output=True, timeout=30).returncode != 0


SHORT_RUN = {  # through the ${...:-default} entries of the compose files
    "DEMO_SECONDS": "6",
    "DEMO_FRAMES_PER_BATCH": "50",
    "DEMO_PUBLISH_EVERY": "10",
    "DEMO_WARMUP_FRAMES": "200",
    "DEMO_RANDOM_FRAMES": "100",
}


def scrape(port: int) -> dict[str, float]:
    """A server's Prometheus metrics: {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        series: float(value)
        for series, _, value in (line.rpartition(" ") for line in text.splitlines())
        if series and not series.startswith("#")
    }


def run_to_completion(
    compose: Mapping[str, Any], loopback: Loopback, tmp_path: Path
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """Run the stack until the trainer and the collectors exit, then stop the servers. Checks
    that every process exited 0 and every collector ended on the trainer's final version, and
    returns the trainer's summary and the metrics of each server with a metrics port (9100),
    scraped before it was stopped."""
    services = compose["services"]
    with running(compose, loopback, tmp_path) as started:
        finite = [p for name, ps in started.items() if not is_server(services[name]) for p in ps]
        codes = [p.wait(timeout=150) for p in finite]
        servers = [name for name in started if is_server(services[name])]
        metrics = {name: scrape(loopback.port(name, 9100)) for name in servers if (name, "9100") in loopback.ports}
        server_codes = [stop(p) for name in reversed(servers) for p in started[name]]
    assert codes == [0] * len(finite) and server_codes == [0] * len(server_codes), logs(tmp_path)
    summary = json.loads((tmp_path / "volumes" / "spool" / "summary.json").read_text())
    collectors = sum(replicas(service) for name, service in services.items() if name.startswith("collector"))
    assert len(summary["collectors"]) == collectors, logs(tmp_path)
    for report in summary["collectors"].values():
        assert report["final_version"] == summary["final_version"], report
        assert report["versions_applied"] >= 2, report
    assert summary["spool_empty"] and summary["frames_consumed"] == summary["frames_collected"] > 0
    return summary, metrics


@pytest.mark.slow
def test_compose_services_run_on_loopback(compose: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Start exactly what compose would start; the collectors end on the trainer's last version."""
    for name, value in SHORT_RUN.items():
        monkeypatch.setenv(name, value)
    summary, metrics = run_to_completion(compose, Loopback(compose, tmp_path), tmp_path)
    assert metrics["weightserver"]['weightserver_latest_version{model="policy"}'] == summary["final_version"]
    # the server kept the versions in its data-dir volume
    assert (tmp_path / "volumes" / "weights" / "policy").is_dir()


# ---------------------------------------------------------------- the two-level tree
def test_compose_tree_primary_relays_and_collectors(compose: dict[str, Any], tree: dict[str, Any], tmp_path: Path):
    """docker/compose.tree.yaml: the primary and the demo as in compose.yaml; each relay follows
    the primary and shares its --shm-dir volume with its 2 collectors, which fetch from it."""
    services = tree["services"]
    assert set(services) == {"weightserver", "relay-a", "relay-b", "trainer", "collector-a", "collector-b"}
    assert tree["x-image"] == compose["x-image"] and tree["x-build"] == compose["x-build"]  # the same image
    primary = services["weightserver"]
    assert primary["command"] == compose["services"]["weightserver"]["command"]
    primary_port = serve_options(primary["command"]).port
    assert str(primary_port) in primary["expose"]
    relays = {name: serve_options(s["command"]) for name, s in services.items() if "--upstream" in s["command"]}
    assert set(relays) == {"relay-a", "relay-b"}
    for name, options in relays.items():
        service = services[name]
        assert options.upstream == f"weightserver:{primary_port}", name
        assert {str(options.port), str(options.bulk_port), str(options.metrics_port)} <= set(service["expose"]), name
        assert service["depends_on"]["weightserver"]["condition"] == "service_healthy"
        [shm_volume] = [v for v, target in volume_mounts(service).items() if target == str(options.shm_dir)]
        assert tree["volumes"][shm_volume]["driver_opts"]["type"] == "tmpfs", shm_volume
        followers = [
            c for c, s in services.items() if environment_of(s).get("WEIGHTSERVER_ADDRESS") == f"{name}:{options.port}"
        ]
        assert sum(replicas(services[c]) for c in followers) == 2, (name, followers)
        for collector in followers:
            follower = services[collector]
            assert follower["command"] == compose["services"]["collector"]["command"]
            assert follower["depends_on"] == {name: {"condition": "service_healthy"}}, collector
            # the relay hands out paths: its collectors mount its tmpfs at the same path, read-only
            assert f"{shm_volume}:{options.shm_dir}:ro" in follower["volumes"], collector
            assert "spool:/spool" in follower["volumes"], collector
            # settings as in compose.yaml but for the address
            expected = {
                **environment_of(compose["services"]["collector"]),
                "WEIGHTSERVER_ADDRESS": f"{name}:{options.port}",
            }
            assert environment_of(follower) == expected, collector
    collectors = [name for name in services if name.startswith("collector")]
    trainer = environment_of(services["trainer"])
    assert trainer == {**environment_of(compose["services"]["trainer"]), "DEMO_COLLECTORS": "4"}
    assert trainer["WEIGHTSERVER_ADDRESS"] == f"weightserver:{primary_port}"  # publishes to the primary
    assert int(trainer["DEMO_COLLECTORS"]) == sum(replicas(services[name]) for name in collectors)
    check_variables_and_volumes(tree, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compose_tree_runs_on_loopback(tree: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Start exactly what compose.tree.yaml would start: the trainer publishes to the primary,
    and every collector ends on its final version, fetched through its relay."""
    for name, value in SHORT_RUN.items():
        monkeypatch.setenv(name, value)
    summary, metrics = run_to_completion(tree, Loopback(tree, tmp_path), tmp_path)
    final = summary["final_version"]
    assert set(metrics) == {"weightserver", "relay-a", "relay-b"}
    assert metrics["weightserver"]['weightserver_latest_version{model="policy"}'] == final
    for relay, series in metrics.items():
        if relay == "weightserver":
            continue
        assert series['weightserver_latest_version{model="policy"}'] == final, (relay, logs(tmp_path))
        assert series["weightserver_relay_upstream_up"] == 1, relay
        # its collectors read its files in the tmpfs volume they share
        assert series['weightserver_fetch_bytes_total{model="policy",transport="shm"}'] > 0, (relay, series)
