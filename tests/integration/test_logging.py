"""Server logs: human-readable lines by default, one JSON object per line with --log-format json,
read from a real `weightserver serve` process."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from datetime import datetime

import pytest

from weightclient.core.service_client import WeightServiceClient
from weightserver.cli import build_parser
from weightserver.logs import JsonFormatter, configure_logging
from weightserver.process import ServerProcess
from weightserver.protocol.safetensors_format import build_header

MODEL = "policy"


def weights(nbytes: int) -> bytes:
    prefix, _ = build_header([("w", "U8", (nbytes,), nbytes)])
    return prefix + b"\x07" * nbytes


def publish_and_fetch(address: str) -> bytes:
    """One publish by "trainer-1" and two fetches (stream, bulk) by "collector-7"; the bytes."""
    data = weights(5000)
    with WeightServiceClient(address, client_id="trainer-1") as trainer:
        assert trainer.publish_bytes(MODEL, data, transport="stream").version == 1
    with WeightServiceClient(address, client_id="collector-7") as collector:
        for transport in ("stream", "bulk"):
            fetched = collector.fetch_bytes(MODEL, transport=transport)
            assert fetched is not None and bytes(fetched.data) == data
    return data


def json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines
    return [json.loads(line) for line in lines]  # every line, or the test fails


def test_json_log_lines_carry_each_transfers_fields():
    with ServerProcess("--log-format", "json") as process:
        data = publish_and_fetch(process.address)
    records = json_lines(process.log())
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys()
        datetime.fromisoformat(record["time"])
    assert any(r["message"].startswith("serving on 127.0.0.1:") for r in records)

    (publish,) = [r for r in records if r.get("event") == "publish"]
    assert publish["level"] == "INFO" and publish["logger"] == "weightserver.service.servicer"
    assert publish["model"] == MODEL and publish["version"] == 1 and publish["bytes"] == len(data)
    assert publish["client_id"] == "trainer-1" and publish["transport"] == "stream"
    assert isinstance(publish["duration_ms"], float) and publish["duration_ms"] >= 0
    # Its phases, each timed by the server, lie within the call.
    phases = [publish[k] for k in ("receive_ms", "verify_ms", "commit_ms")]
    assert all(p >= 0 for p in phases) and sum(phases) <= publish["duration_ms"]
    assert re.fullmatch(r"ipv4:127\.0\.0\.1:\d+", publish["peer"])
    assert publish["message"].startswith(f"publish model={MODEL} version=1 bytes={len(data)} ")

    fetches = [r for r in records if r.get("event") == "fetch"]
    assert [f["transport"] for f in fetches] == ["stream", "bulk"]
    for fetch in fetches:
        assert (fetch["model"], fetch["version"], fetch["bytes"]) == (MODEL, 1, len(data))
        assert fetch["client_id"] == "collector-7"
        assert isinstance(fetch["duration_ms"], float) and fetch["duration_ms"] >= 0
        assert fetch["peer"].startswith("ipv4:127.0.0.1:")


def test_log_format_from_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSERVER_LOG_FORMAT", "json")
    with ServerProcess() as process:
        publish_and_fetch(process.address)
    assert [r["client_id"] for r in json_lines(process.log()) if r.get("event") == "publish"] == ["trainer-1"]


def test_default_format_is_human_readable(monkeypatch):
    monkeypatch.delenv("WEIGHTSERVER_LOG_FORMAT", raising=False)
    with ServerProcess() as process:
        data = publish_and_fetch(process.address)
    lines = [line for line in process.log().splitlines() if line.strip()]
    for line in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
    publishes = [line for line in lines if " weightserver.service.servicer: publish " in line]
    assert len(publishes) == 1
    assert re.search(
        rf"INFO weightserver\.service\.servicer: publish model={MODEL} version=1 bytes={len(data)} transport=stream "
        r"duration_ms=\d+\.\d receive_ms=\d+\.\d verify_ms=\d+\.\d commit_ms=\d+\.\d "
        r"peer=ipv4:127\.0\.0\.1:\d+ client=trainer-1$",
        publishes[0],
    ), publishes[0]


def serve_with(variable: str, value: str) -> subprocess.CompletedProcess[str]:
    """`weightserver serve` with `variable` set to `value` in its environment (it exits on a bad one)."""
    return subprocess.run(
        [sys.executable, "-m", "weightserver", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, variable: value},
    )


def test_bad_log_format_in_the_environment_is_refused():
    result = serve_with("WEIGHTSERVER_LOG_FORMAT", "xml")
    assert result.returncode == 2
    assert "WEIGHTSERVER_LOG_FORMAT must be one of text, json, got 'xml'" in result.stderr


def test_bad_log_level_in_the_environment_is_refused():
    """As a bad $WEIGHTSERVER_LOG_FORMAT is: a usage error naming the variable and the levels. Before,
    logging's ValueError ("Unknown level: 'VERBOSE'") escaped as a traceback."""
    result = serve_with("WEIGHTSERVER_LOG_LEVEL", "verbose")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "WEIGHTSERVER_LOG_LEVEL must be one of debug, info, warning, error, got 'verbose'" in result.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve"], None),
        (["serve", "--log-format", "json"], "json"),
        (["--log-format", "json", "serve"], "json"),
        (["--log-format", "json", "serve", "--log-format", "text"], "text"),
        (["--log-format", "json", "ls"], "json"),
    ],
)
def test_log_format_option_before_or_after_serve(argv, expected):
    assert build_parser().parse_args(argv).log_format == expected


def test_json_formatter_emits_extra_fields_and_exceptions():
    record = logging.LogRecord("weightserver.test", logging.WARNING, __file__, 1, "got %d", (3,), None)
    record.__dict__.update({"model": "policy", "bytes": 12, "client_id": None})
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "WARNING" and entry["logger"] == "weightserver.test" and entry["message"] == "got 3"
    assert (entry["model"], entry["bytes"], entry["client_id"]) == ("policy", 12, None)
    assert not {"msg", "args", "levelno", "pathname", "exc_info"} & entry.keys()

    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    entry = json.loads(JsonFormatter().format(failed))
    assert "RuntimeError: boom" in entry["exception"]


def test_configure_logging_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        configure_logging("info", "xml", io.StringIO())
