"""The `weightserver` command line: serve, publish, fetch, ls, watch, delete, pin.

Environment variables are read here and nowhere else: `WEIGHTSERVER_ADDRESS` (default server
for the client commands), `WEIGHTSERVER_LOG_LEVEL` and `WEIGHTSERVER_LOG_FORMAT`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from weightserver import __version__
from weightserver.config import DEFAULT_CHUNK_BYTES, DEFAULT_PORT, ServerConfig
from weightserver.errors import WeightServerError
from weightserver.logs import LOG_FORMATS, configure_logging
from weightserver.progress import TransferProgress

if TYPE_CHECKING:
    from weightclient.version_info import VersionInfo

log = logging.getLogger("weightserver")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '4096' -> 4096."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a unit, e.g. 512MiB, 2GiB, 1GB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_meta(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"invalid metadata {text!r}: use KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightserver",
        description="A gRPC weight server for distributed RL: trainers publish versioned weights, "
        "collectors fetch or watch them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_log_options(parser, default=None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the server", description="Run a weight server until SIGTERM/SIGINT.")
    # Also after `serve`, where server options go; given there, they win over the global ones.
    _add_log_options(serve, default=argparse.SUPPRESS)
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port to bind, 0 for a free one (default: %(default)s)"
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory to persist versions in; without it they live in memory only",
    )
    serve.add_argument(
        "--keep", type=int, default=3, help="versions kept per model besides pinned ones (default: %(default)s)"
    )
    serve.add_argument(
        "--max-model-bytes",
        type=parse_size,
        default=ServerConfig.max_model_bytes,
        help="largest version accepted, e.g. 2GiB (default: 16GiB)",
    )
    serve.add_argument(
        "--chunk-bytes",
        type=parse_size,
        default=DEFAULT_CHUNK_BYTES,
        help="default fetch chunk size, 64KiB-3MiB (default: 1MiB)",
    )
    serve.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds running calls get to finish on shutdown (default: %(default)s)",
    )
    serve.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="TCP port for bulk transfers of large fetches (default: a free one; expose it beside --port)",
    )
    serve.add_argument("--no-bulk", action="store_true", help="serve fetches over gRPC streams only")
    serve.add_argument(
        "--shm-dir",
        type=Path,
        default=None,
        help="where to put this server's shared-memory payload files, which same-host collectors "
        "read directly; a tmpfs, e.g. a /dev/shm volume shared in compose (default: /dev/shm)",
    )
    serve.add_argument("--no-shm", action="store_true", help="never hand out shared-memory files")
    serve.add_argument(
        "--payload-cache-bytes",
        type=parse_size,
        default=ServerConfig.payload_cache_bytes,
        help="memory for derived payloads (deltas, bf16/fp16 casts), e.g. 2GiB (default: 1GiB)",
    )
    serve.add_argument(
        "--auth-tokens",
        type=Path,
        default=None,
        metavar="FILE",
        help="require bearer tokens listed in FILE, one 'ROLE NAME TOKEN' per line; roles: reader "
        "(fetch/watch/list), publisher (+ publish), admin (+ delete/pin). Health checks need none",
    )
    serve.add_argument(
        "--tls-cert", type=Path, default=None, metavar="PEM", help="serve TLS with this certificate chain"
    )
    serve.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="mutual TLS: accept only clients whose certificate this CA signed",
    )
    serve.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=ServerConfig.max_concurrent_streams,
        help="calls one client connection may have open at once (default: %(default)s)",
    )
    serve.add_argument(
        "--publish-timeout",
        type=float,
        default=ServerConfig.publish_timeout,
        metavar="SECONDS",
        help="drop a publish stream that takes longer than this; 0 for no limit (default: %(default)s)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over plain HTTP at http://HOST:PORT/metrics, 0 for a free port (default: off)",
    )
    serve.add_argument(
        "--port-file",
        type=Path,
        default=None,
        help="write the bound port to this file once serving (useful with --port 0)",
    )
    serve.set_defaults(handler=cmd_serve)

    def client_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        sub.add_argument(
            "--server",
            default=None,
            help="host:port of the server (default: $WEIGHTSERVER_ADDRESS, else localhost:50051)",
        )
        sub.add_argument(
            "--token-file",
            type=Path,
            default=None,
            help="read the bearer token from this file (default: $WEIGHTSERVER_TOKEN, if set)",
        )
        sub.add_argument(
            "--tls-ca",
            type=Path,
            default=None,
            metavar="PEM",
            help="connect with TLS, trusting this CA (default: $WEIGHTSERVER_TLS_CA; plaintext if neither)",
        )
        sub.add_argument("--tls-cert", type=Path, default=None, metavar="PEM", help="client certificate (mutual TLS)")
        sub.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="private key of --tls-cert")
        return sub

    publish = client_command("publish", "publish a .safetensors file as a new version and print its number")
    publish.add_argument("file", type=Path, help="a .safetensors file")
    publish.add_argument("--model", required=True, help="model name, e.g. policy")
    publish.add_argument(
        "--version", dest="version_number", type=int, default=0, help="version number to request (default: next one)"
    )
    publish.add_argument(
        "--meta",
        type=parse_meta,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="metadata to store with the version (repeatable)",
    )
    publish.add_argument("--pin", action="store_true", help="keep this version beyond --keep")
    publish.add_argument("--json", action="store_true", help="print the version's description as JSON")
    publish.set_defaults(handler=cmd_publish)

    fetch = client_command("fetch", "fetch a version into a .safetensors file")
    fetch.add_argument("--model", required=True, help="model name")
    fetch.add_argument(
        "--version", dest="version_number", type=int, default=None, help="exact version (default: latest)"
    )
    fetch.add_argument("-o", "--output", type=Path, required=True, help="file to write")
    fetch.set_defaults(handler=cmd_fetch)

    ls = client_command("ls", "list models, or the versions of one model")
    ls.add_argument("--model", default=None, help="list this model's versions and tensors")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(handler=cmd_ls)

    watch = client_command("watch", "print a line for every new version of a model until interrupted")
    watch.add_argument("--model", required=True, help="model name")
    watch.add_argument(
        "--since",
        type=int,
        default=None,
        help="last version you know; older retained versions are printed first (default: latest)",
    )
    watch.add_argument("--json", action="store_true", help="print one JSON object per version")
    watch.set_defaults(handler=cmd_watch)

    delete = client_command("delete", "delete one version")
    delete.add_argument("--model", required=True, help="model name")
    delete.add_argument("--version", dest="version_number", type=int, required=True, help="version to delete")
    delete.set_defaults(handler=cmd_delete)

    pin = client_command("pin", "pin a version so --keep never evicts it (or --unpin)")
    pin.add_argument("--model", required=True, help="model name")
    pin.add_argument("--version", dest="version_number", type=int, required=True, help="version to pin")
    pin.add_argument("--unpin", action="store_true", help="unpin instead")
    pin.set_defaults(handler=cmd_pin)
    return parser


def _add_log_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: $WEIGHTSERVER_LOG_LEVEL, else info)",
    )
    parser.add_argument(
        "--log-format",
        default=default,
        choices=LOG_FORMATS,
        help="text: human-readable lines; json: one JSON object per line with time, level, logger, "
        "message and the event's fields (default: $WEIGHTSERVER_LOG_FORMAT, else text)",
    )


# ---------------------------------------------------------------------- commands
def cmd_serve(args: argparse.Namespace) -> int:
    from weightserver.server import WeightServer

    config = ServerConfig(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        keep=args.keep,
        max_model_bytes=args.max_model_bytes,
        chunk_bytes=args.chunk_bytes,
        grace_seconds=args.grace,
        bulk_port=None if args.no_bulk else args.bulk_port,
        shm_dir=None if args.no_shm else (args.shm_dir or "auto"),
        payload_cache_bytes=args.payload_cache_bytes,
        auth_tokens=args.auth_tokens,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_concurrent_streams=args.max_concurrent_streams,
        publish_timeout=args.publish_timeout or None,
        metrics_port=args.metrics_port,
    )
    server = WeightServer(config).start()
    if args.port_file is not None:
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(f"{server.port}\n")
        tmp.replace(args.port_file)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not server.wait(timeout=0.5):
        pass
    return 0


def _client(args: argparse.Namespace):  # -> WeightServiceClient
    from weightclient.service_client import WeightServiceClient

    token = args.token_file.read_text().strip() if args.token_file is not None else None
    return WeightServiceClient(
        args.server, token=token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
    )


def cmd_publish(args: argparse.Namespace) -> int:
    data = args.file.read_bytes()
    with _client(args) as client, TransferProgress(f"publish {args.model}") as progress:
        info = client.publish_bytes(
            args.model, data, version=args.version_number, metadata=dict(args.meta), pin=args.pin, progress=progress
        )
    print(json.dumps(_info_json(info), indent=1) if args.json else info.version)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    with _client(args) as client, TransferProgress(f"fetch {args.model}") as progress:
        fetched = client.fetch_bytes(args.model, version=args.version_number, progress=progress)
    assert fetched is not None
    tmp = args.output.with_name(args.output.name + ".part")
    tmp.write_bytes(fetched.data)
    tmp.replace(args.output)
    info = fetched.info
    print(f"{info.model} v{info.version} -> {args.output} ({info.byte_size} bytes, sha256 {info.sha256})")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.model is None:
            models = client.list_models()
            if args.json:
                print(json.dumps([m.__dict__ for m in models], indent=1))
                return 0
            _table(
                ["MODEL", "LATEST", "VERSIONS", "BYTES"],
                [[m.model, m.latest_version, m.version_count, m.retained_bytes] for m in models],
            )
            return 0
        versions = client.list_versions(args.model)
    if args.json:
        print(json.dumps([_info_json(v) for v in versions], indent=1))
        return 0
    _table(
        ["VERSION", "CREATED", "BYTES", "TENSORS", "PINNED", "SHA256", "METADATA"],
        [
            [
                v.version,
                _when(v.created),
                v.byte_size,
                len(v.tensors),
                "yes" if v.pinned else "",
                v.sha256[:16],
                " ".join(f"{k}={val}" for k, val in sorted(v.metadata.items())),
            ]
            for v in versions
        ],
    )
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from weightserver.errors import ModelNotFound

    with _client(args) as client:
        since = args.since
        if since is None:
            try:
                since = client.latest(args.model).version
            except ModelNotFound:
                since = 0
        print(f"watching {args.model} after version {since} on {client.address}", file=sys.stderr, flush=True)
        for event in client.watch(args.model, since=since):
            info = event.info
            if args.json:
                print(json.dumps({**_info_json(info), "gap": event.gap}), flush=True)
            else:
                gap = "  (some earlier versions were evicted before they could be sent)" if event.gap else ""
                print(f"{info.model} v{info.version} {info.byte_size} bytes sha256 {info.sha256}{gap}", flush=True)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.delete(args.model, args.version_number)
    print(f"deleted {info.model} v{info.version}")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.pin(args.model, args.version_number, pinned=not args.unpin)
    print(f"{'pinned' if info.pinned else 'unpinned'} {info.model} v{info.version}")
    return 0


# ---------------------------------------------------------------------- output
def _info_json(info: VersionInfo) -> dict[str, object]:
    return {
        "model": info.model,
        "version": info.version,
        "byte_size": info.byte_size,
        "sha256": info.sha256,
        "created": info.created.isoformat(),
        "metadata": info.metadata,
        "pinned": info.pinned,
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in info.tensors],
    }


def _when(moment: datetime) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or os.environ.get("WEIGHTSERVER_LOG_LEVEL", "info")
    log_format = (args.log_format or os.environ.get("WEIGHTSERVER_LOG_FORMAT") or "text").lower()
    if log_format not in LOG_FORMATS:
        parser.error(f"$WEIGHTSERVER_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    configure_logging(level, log_format)
    try:
        return args.handler(args)
    except WeightServerError as exc:
        print(f"weightserver {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"weightserver {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
