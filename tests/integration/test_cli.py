"""The `weightserver` console script (weightserver.cli, also `python -m weightserver`) against a
real server."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.test_stalled_server import SlowReads
from weightclient.core.service_client import WeightServiceClient
from weightclient.transports import bulk as bulk_transport
from weightserver import cli
from weightserver.cli import CLIENT_COMMANDS, build_parser, main, parse_size

COMMANDS = ["serve", "publish", "fetch", "ls", "watch", "delete", "pin"]


def _cli(*args: str, module: str = "weightserver", env: dict[str, str] | None = None, **kwargs):
    """`weightserver ARGS` as the console script runs it (`python -m weightserver`)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
        **kwargs,
    )


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "policy.safetensors"
    save_file(
        {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)}, path
    )
    return path


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_on_every_command(command):
    result = _cli(*([command] if command else []), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: weightserver" in result.stdout


def test_the_console_script_is_the_one_command_line():
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"weightserver": "weightserver.cli:main"}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(commands.choices) == COMMANDS == ["serve", *CLIENT_COMMANDS]


def test_python_m_weightserver_is_the_console_script():
    listed = _cli("--help", module="weightserver")
    assert listed.returncode == 0 and "usage: weightserver" in listed.stdout
    assert re.findall(r"^    (\w+) ", listed.stdout, re.MULTILINE) == COMMANDS
    fetch_help = _cli("fetch", "--help", module="weightserver").stdout
    assert "--model MODEL" in fetch_help and "--server SERVER" in fetch_help


def test_publish_fetch_ls_round_trip(server, weights_file, tmp_path, capsys):
    address = ["--server", server.address]
    assert main(["publish", str(weights_file), "--model", "policy", "--meta", "step=10", *address]) == 0
    assert capsys.readouterr().out.strip() == "1"
    assert main(["publish", str(weights_file), "--model", "policy", "--pin", "--json", *address]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["version"] == 2 and described["pinned"] is True
    assert {t["name"]: t["dtype"] for t in described["tensors"]} == {"w": "F32", "b": "BF16"}

    out = tmp_path / "fetched.safetensors"
    assert main(["fetch", "--model", "policy", "--version", "1", "-o", str(out), *address]) == 0
    assert "policy v1" in capsys.readouterr().out
    assert out.read_bytes() == weights_file.read_bytes()
    assert torch.equal(load_file(out)["w"], load_file(weights_file)["w"])

    assert main(["ls", *address]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split() == ["MODEL", "LATEST", "VERSIONS", "BYTES"]
    assert listing[1].split()[:3] == ["policy", "2", "2"]

    assert main(["ls", "--model", "policy", *address]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "step=10" in rows[1] and "yes" in rows[2]

    assert main(["pin", "--model", "policy", "--version", "2", "--unpin", *address]) == 0
    assert main(["delete", "--model", "policy", "--version", "1", *address]) == 0
    assert "deleted policy v1" in capsys.readouterr().out
    assert main(["ls", "--model", "policy", "--json", *address]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)] == [2]


def test_fetch_prints_the_sha256_of_a_version_just_published(server, weights_file, tmp_path, capsys):
    """A version published with only an xxh3 has no sha256 on the server for its first half second
    (VersionInfo.sha256); fetched over a fast transport then, the line still gives the file's."""
    address = ["--server", server.address]
    with WeightServiceClient(server.address) as client:
        client.publish_bytes("fresh", weights_file.read_bytes())
    out = tmp_path / "fresh.safetensors"
    assert main(["fetch", "--model", "fresh", "-o", str(out), *address]) == 0
    expected = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    assert capsys.readouterr().out.strip().endswith(f"bytes, sha256 {expected})")


def test_a_fetch_that_cannot_write_its_file_leaves_nothing_behind(server, weights_file, tmp_path, capsys):
    """`fetch -o` naming a directory fails with a message, and the file it wrote to move there
    (`<output>.part`) goes too. Before, that file stayed beside the target: a stray copy of the
    weights after every fetch that failed at its last step (the same for a full disk)."""
    address = ["--server", server.address]
    assert main(["publish", str(weights_file), "--model", "policy", *address]) == 0
    target = tmp_path / "weights"
    target.mkdir()
    assert main(["fetch", "--model", "policy", "-o", str(target), *address]) == 1
    assert "Is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.safetensors", "weights"]


def test_fetch_runs_as_long_as_bytes_keep_coming(make_server, tmp_path, monkeypatch, capsys):
    """A file whose transfer outlasts the client's timeout, its bytes never pausing that long:
    fetched (the client's timeout bounds each wait for bytes, not the whole transfer)."""
    server = make_server(shm_dir=None)  # over bulk, read slowly below
    big = tmp_path / "big.safetensors"
    save_file({"w": torch.arange(4 << 20, dtype=torch.float32)}, big)  # 16 MiB
    assert main(["publish", str(big), "--model", "policy", "--server", server.address]) == 0
    monkeypatch.setattr(cli, "WeightServiceClient", functools.partial(WeightServiceClient, timeout=1.0))
    connect = bulk_transport._connect
    monkeypatch.setattr(bulk_transport, "_connect", lambda *args: SlowReads(connect(*args)))
    out = tmp_path / "fetched.safetensors"
    began = time.monotonic()
    assert main(["fetch", "--model", "policy", "-o", str(out), "--server", server.address]) == 0
    assert time.monotonic() - began > 2.0  # 16 reads of 1 MiB, 0.15 s apart, against a 1 s timeout
    assert out.read_bytes() == big.read_bytes()


def test_errors_exit_1_with_a_message(server, tmp_path, capsys):
    bogus = tmp_path / "not.safetensors"
    bogus.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    assert main(["publish", str(bogus), "--model", "policy", "--server", server.address]) == 1
    err = capsys.readouterr().err
    assert "InvalidSafetensors" in err and "not valid JSON" in err
    assert main(["fetch", "--model", "nope", "-o", str(tmp_path / "x"), "--server", server.address]) == 1
    assert "ModelNotFound: no model 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_server_address_from_environment(server, weights_file):
    result = _cli("publish", str(weights_file), "--model", "critic", env={"WEIGHTSERVER_ADDRESS": server.address})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_unreachable_server_is_reported(weights_file):
    result = _cli("publish", str(weights_file), "--model", "policy", "--server", "127.0.0.1:1")
    assert result.returncode == 1
    assert "ServerUnavailable" in result.stderr and "127.0.0.1:1" in result.stderr


def test_watch_prints_each_new_version(server, weights_file):
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightserver",
            "watch",
            "--model",
            "policy",
            "--since",
            "0",
            "--json",
            "--server",
            server.address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for expected in (1, 2, 3):
            assert _cli("publish", str(weights_file), "--model", "policy", "--server", server.address).returncode == 0
            event = json.loads(watch.stdout.readline())
            assert event["version"] == expected and event["gap"] is False
    finally:
        watch.terminate()
        watch.communicate(timeout=10)  # also closes the pipes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("1KiB", 1024), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1GB", 10**9), ("1.5MiB", 1572864)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_bad_size_is_refused():
    result = _cli("serve", "--max-model-bytes", "lots")
    assert result.returncode == 2
    assert "invalid size 'lots'" in result.stderr


def test_serve_on_a_port_in_use_exits_1_with_a_message(server):
    """`serve --port P` with P taken ends with status 1 and a line naming the port. Before, gRPC's
    RuntimeError from add_insecure_port escaped the CLI's error handling: a traceback."""
    port = str(server.port)
    result = _cli("serve", "--host", "127.0.0.1", "--port", port, "--no-bulk", "--no-shm")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"weightserver serve: could not bind 127.0.0.1:{port}: is the port in use?" in result.stderr


@pytest.mark.parametrize("option", ["--bulk-port", "--metrics-port"])
def test_serve_names_the_port_in_use(server, option):
    """A taken --bulk-port or --metrics-port is named in the error. Before, the message was the
    socket's alone ("[Errno 98] Address already in use"), which of the three ports left to guess."""
    port = str(server.port)
    result = _cli("serve", "--host", "127.0.0.1", "--port", "0", "--no-shm", option, port)
    assert result.returncode == 1, result.stderr
    assert f"could not bind 127.0.0.1:{port} ({option}): " in result.stderr


@pytest.mark.parametrize("command", [["publish", "x.safetensors"], ["fetch", "-o", "x"], ["delete"], ["pin"]])
def test_a_version_no_version_field_holds_is_a_usage_error_naming_the_option(command):
    """`--version -1` is refused by the command line, naming the option. Before, protobuf's own
    ValueError came back alone: "weightserver publish: Value out of range: -1", no option named."""
    result = _cli(*command, "--model", "policy", "--version", "-1", "--server", "127.0.0.1:1")
    assert result.returncode == 2, result.stderr
    assert "argument --version: invalid version '-1'" in result.stderr


@pytest.mark.parametrize("value", ["-1", str(2**64)])
def test_a_watch_since_no_version_field_holds_is_a_usage_error_naming_the_option(value):
    """`watch --since` takes what a version field holds, as --version does, with the range named.
    Before, it was any int: 2**64 reached the client and protobuf's ValueError came back."""
    result = _cli("watch", "--model", "policy", "--since", value, "--server", "127.0.0.1:1")
    assert result.returncode == 2, result.stderr
    assert f"argument --since: invalid version '{value}'" in result.stderr
    assert "from 0 to 2**64-1" in result.stderr
