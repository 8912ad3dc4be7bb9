"""The `weightserver` console script: `serve` and the client commands. A composition root: it
imports the client core; `WEIGHTSERVER_LOG_*` and `WEIGHTSERVER_UPSTREAM_TOKEN` are read here only."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from weightclient.core.service_client import WeightServiceClient
from weightserver import __version__
from weightserver.config import ServerConfig
from weightserver.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from weightserver.protocol.digests import sha256_hex
from weightserver.protocol.errors import InvalidRequest, ModelNotFound, WeightServerError
from weightserver.protocol.limits import MiB, version_number
from weightserver.protocol.version_info import VersionInfo

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("weightserver")

# A relay's upstream token without --upstream-token-file: a secret kept out of the process list.
UPSTREAM_TOKEN_ENV = "WEIGHTSERVER_UPSTREAM_TOKEN"
CLIENT_COMMANDS = ("publish", "fetch", "ls", "watch", "delete", "pin")
PROGRESS_MIN_BYTES = 8 * MiB
Handler = Callable[[argparse.Namespace], None]

# A number, then no unit, B, or K/M/G/T alone or with "B" (powers of 1000) or with "iB" (powers of 1024).
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?B)?|B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '4096' -> 4096."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a unit, e.g. 512MiB, 2GiB, 1GB")
    number, prefix, suffix = match.groups()
    power = "KMGT".index(prefix.upper()) + 1 if prefix else 0
    return int(float(number) * (1024 if suffix and len(suffix) == 2 else 1000) ** power)


def _model_list(text: str) -> tuple[str, ...]:
    """'policy,critic' -> ('policy', 'critic')."""
    models = tuple(name.strip() for name in text.split(",") if name.strip())
    if not models:
        raise argparse.ArgumentTypeError(f"invalid model list {text!r}: name them with commas, e.g. policy,critic")
    return models


def _version_number(text: str) -> int:
    """A --version or --since: a whole number a version field holds (the server says which it takes)."""
    try:
        return version_number(int(text), "it")
    except (ValueError, InvalidRequest) as exc:
        why = exc if isinstance(exc, InvalidRequest) else "it must be a whole number"
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: {why}") from None


def _parse_meta(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"invalid metadata {text!r}: use KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The whole `weightserver` command line: global options, `serve` and the client commands."""
    parser = argparse.ArgumentParser(
        prog="weightserver",
        description="A gRPC weight server for distributed RL: trainers publish versioned weights, "
        "collectors fetch or watch them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_log_options(parser, default=None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_client_commands(commands)
    return parser


def _add_log_options(parser: argparse.ArgumentParser, default: object) -> None:
    level = "log verbosity (default: $WEIGHTSERVER_LOG_LEVEL, else info)"
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS, help=level)
    lines = "text lines, or json: one object per line with its fields (default: $WEIGHTSERVER_LOG_FORMAT, else text)"
    parser.add_argument("--log-format", default=default, choices=LOG_FORMATS, help=lines)


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser("serve", help="run the server", description="Run a weight server until SIGTERM/SIGINT.")
    _add_log_options(serve, default=argparse.SUPPRESS)  # also after `serve`, where they win
    option = serve.add_argument  # defaults: ServerConfig's (set below)
    option("--host", help="address to bind (default: %(default)s)")
    option("--port", type=int, help="port to bind, 0 for a free one (default: %(default)s)")
    option("--port-file", type=Path, help="write the bound port to this file once serving (useful with --port 0)")
    option("--data-dir", type=Path, help="directory to persist versions in; without it they live in memory only")
    option("--keep", type=int, help="versions kept per model besides pinned ones (default: %(default)s)")
    option("--max-model-bytes", type=parse_size, help="largest version accepted, e.g. 2GiB (default: 16GiB)")
    option("--chunk-bytes", type=parse_size, help="default fetch chunk size, 64KiB-3MiB (default: 1MiB)")
    option("--payload-cache-bytes", type=parse_size, help="memory for deltas and bf16/fp16 casts (default: 1GiB)")
    option("--grace", dest="grace_seconds", type=float, help="seconds calls get to finish on shutdown (default: 5)")
    option("--bulk-port", type=int, help="TCP port for bulk transfers, beside --port (default: a free one)")
    option("--no-bulk", action="store_true", help="serve fetches over gRPC streams only")
    bulk = "bulk connections open at once; one more is closed, its client uses the stream (default: %(default)s)"
    option("--bulk-max-connections", type=int, metavar="N", help=bulk)
    option("--shm-dir", type=Path, help="tmpfs for shared-memory files same-host clients read (default: /dev/shm)")
    option("--no-shm", action="store_true", help="never hand out shared-memory files")
    tokens = (
        "require bearer tokens listed in FILE, one 'ROLE NAME TOKEN' per line; roles: reader (fetch/watch/list), "
        "publisher (+ publish), admin (+ delete/pin); 'publisher:a,b' may change only models a and b"
    )
    option("--auth-tokens", type=Path, metavar="FILE", help=tokens)
    option("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate chain")
    option("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    option("--tls-client-ca", type=Path, metavar="PEM", help="mutual TLS: accept only client certificates it signed")
    option("--max-concurrent-streams", type=int, help="calls one connection may have open (default: %(default)s)")
    fetches = "stream fetches sending at once; the rest wait, so publishes are not starved (default: %(default)s)"
    option("--max-stream-fetches", type=int, metavar="N", help=fetches)
    timeout = "drop a publish stream that takes longer; 0 for no limit (default: %(default)s)"
    option("--publish-timeout", type=float, metavar="SECONDS", help=timeout)
    option("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics over HTTP, 0 for a free port")
    relay = serve.add_argument_group("relay", "Follow another server and serve its versions (default: a primary).")
    upstream = "host:port of a primary or relay to follow; publishes, deletes and pins are refused here"
    relay.add_argument("--upstream", metavar="ADDRESS", help=upstream)
    models = "follow only these models (default: every one, including later ones)"
    relay.add_argument("--models", dest="upstream_models", type=_model_list, metavar="A,B", help=models)
    poll = "how often to list the upstream's models: new ones, and whether it is up (default: %(default)s)"
    relay.add_argument("--upstream-poll", dest="upstream_poll_seconds", type=float, metavar="SECONDS", help=poll)
    token = f"bearer token for an upstream with --auth-tokens, role reader or above (default: ${UPSTREAM_TOKEN_ENV})"
    relay.add_argument("--upstream-token-file", type=Path, metavar="FILE", help=token)
    relay.add_argument("--upstream-tls", action="store_true", help="dial over TLS trusting the system's roots")
    relay.add_argument("--upstream-tls-ca", type=Path, metavar="PEM", help="dial over TLS trusting this CA instead")
    relay.add_argument("--upstream-tls-cert", type=Path, metavar="PEM", help="client certificate, for mutual TLS")
    relay.add_argument("--upstream-tls-key", type=Path, metavar="PEM", help="private key of --upstream-tls-cert")
    # ServerConfig's defaults, but for --shm-dir: argparse would make its "auto" a Path.
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.name != "shm_dir"}
    serve.set_defaults(handler=cmd_serve, **defaults)


def _add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def command(name: str, help_text: str, handler: Handler, *, model: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        sub.set_defaults(handler=handler)
        option = sub.add_argument
        option("--server", help="host:port (default: $WEIGHTSERVER_ADDRESS, else localhost:50051)")
        option("--token-file", type=Path, help="file of the bearer token (default: $WEIGHTSERVER_TOKEN)")
        option("--tls-ca", type=Path, metavar="PEM", help="TLS trusting this CA (default: $WEIGHTSERVER_TLS_CA)")
        option("--tls-cert", type=Path, metavar="PEM", help="client certificate (mutual TLS)")
        option("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
        if model:
            option("--model", required=True, help="model name, e.g. policy")
        return sub

    def version(sub: argparse.ArgumentParser, help_text: str, **kwargs: object) -> None:
        sub.add_argument("--version", dest="version_number", type=_version_number, help=help_text, **kwargs)  # type: ignore[arg-type]

    publish = command("publish", "publish a .safetensors file as a new version and print its number", cmd_publish)
    publish.add_argument("file", type=Path, help="a .safetensors file")
    version(publish, "version number to request (default: next one)", default=0)
    meta = "metadata to store with the version (repeatable)"
    publish.add_argument("--meta", type=_parse_meta, action="append", default=[], metavar="KEY=VALUE", help=meta)
    publish.add_argument("--pin", action="store_true", help="keep this version beyond --keep")
    publish.add_argument("--json", action="store_true", help="print the version's description as JSON")

    fetch = command("fetch", "fetch a version into a .safetensors file", cmd_fetch)
    version(fetch, "exact version (default: latest)")
    fetch.add_argument("-o", "--output", type=Path, required=True, help="file to write")

    ls = command("ls", "list models, or the versions of one model", cmd_ls, model=False)
    ls.add_argument("--model", help="list this model's versions and tensors")
    ls.add_argument("--json", action="store_true", help="print JSON")

    watch = command("watch", "print a line for every new version of a model until interrupted", cmd_watch)
    since = "last version you know; later ones come first (default: latest)"
    watch.add_argument("--since", type=_version_number, help=since)
    watch.add_argument("--json", action="store_true", help="print one JSON object per version")

    version(command("delete", "delete one version", cmd_delete), "version to delete", required=True)
    pin = command("pin", "pin a version so --keep never evicts it (or --unpin)", cmd_pin)
    version(pin, "version to pin", required=True)
    pin.add_argument("--unpin", action="store_true", help="unpin instead")


def server_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """The ServerConfig of parsed `serve` options; ValueError for a combination it refuses."""
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    options["bulk_port"] = None if args.no_bulk else args.bulk_port
    options["shm_dir"] = None if args.no_shm else (args.shm_dir or "auto")
    options["publish_timeout"] = args.publish_timeout or None
    path = args.upstream_token_file
    if path is not None:
        try:
            options["upstream_token"] = path.read_text()
        except OSError as exc:
            raise ValueError(f"--upstream-token-file {path}: {exc.strerror}") from None
    elif args.upstream is not None:  # a primary's environment may hold it for other programs: not read
        options["upstream_token"] = environ.get(UPSTREAM_TOKEN_ENV) or None
    return ServerConfig(**options)


def cmd_serve(args: argparse.Namespace) -> None:
    from weightserver.server import WeightServer

    server = WeightServer(server_config(args)).start()
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


def _client(args: argparse.Namespace) -> WeightServiceClient:
    token = args.token_file.read_text().strip() if args.token_file is not None else None
    return WeightServiceClient(
        args.server, token=token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
    )


def cmd_publish(args: argparse.Namespace) -> None:
    data = args.file.read_bytes()
    with _client(args) as client, TransferProgress(f"publish {args.model}") as progress:
        info = client.publish_bytes(
            args.model, data, version=args.version_number, metadata=dict(args.meta), pin=args.pin, progress=progress
        )
    print(json.dumps(_info_json(info), indent=1) if args.json else info.version)


def cmd_fetch(args: argparse.Namespace) -> None:
    with _client(args) as client, TransferProgress(f"fetch {args.model}") as progress:
        # As long as bytes keep coming (a large file over a slow link), up to the client's timeout between them
        fetched = client.fetch_bytes(args.model, version=args.version_number, progress=progress, stall=client.timeout)
    assert fetched is not None
    tmp = args.output.with_name(args.output.name + ".part")
    try:
        tmp.write_bytes(fetched.data)
        tmp.replace(args.output)
    except OSError:  # (a full disk, an output that is a directory): no partial copy is left behind
        tmp.unlink(missing_ok=True)
        raise
    info = fetched.info
    sha256 = info.sha256 or sha256_hex(fetched.data)  # (a fresh version's may not be computed yet: VersionInfo)
    print(f"{info.model} v{info.version} -> {args.output} ({info.byte_size} bytes, sha256 {sha256})")


def cmd_ls(args: argparse.Namespace) -> None:
    with _client(args) as client:
        if args.model is None:
            models = client.list_models()
            records = [m.__dict__ for m in models]
            headers = ["MODEL", "LATEST", "VERSIONS", "BYTES"]
            rows = [[m.model, m.latest_version, m.version_count, m.retained_bytes] for m in models]
        else:
            versions = client.list_versions(args.model)
            records = [_info_json(v) for v in versions]
            headers = ["VERSION", "CREATED", "BYTES", "TENSORS", "PINNED", "SHA256", "METADATA"]
            rows = [_version_row(v) for v in versions]
    if args.json:
        print(json.dumps(records, indent=1))
        return
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _version_row(v: VersionInfo) -> list[object]:
    created = v.created.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    metadata = " ".join(f"{k}={val}" for k, val in sorted(v.metadata.items()))
    return [v.version, created, v.byte_size, len(v.tensors), "yes" if v.pinned else "", v.sha256[:16], metadata]


def cmd_watch(args: argparse.Namespace) -> None:
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


def cmd_delete(args: argparse.Namespace) -> None:
    with _client(args) as client:
        info = client.delete(args.model, args.version_number)
    print(f"deleted {info.model} v{info.version}")


def cmd_pin(args: argparse.Namespace) -> None:
    with _client(args) as client:
        info = client.pin(args.model, args.version_number, pinned=not args.unpin)
    print(f"{'pinned' if info.pinned else 'unpinned'} {info.model} v{info.version}")


def _info_json(info: VersionInfo) -> dict[str, object]:
    record = {k: getattr(info, k) for k in ("model", "version", "byte_size", "sha256", "created", "metadata", "pinned")}
    record["created"] = info.created.isoformat()  # replaced in place: the keys keep their order
    record["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in info.tensors]
    return record


class TransferProgress(contextlib.AbstractContextManager):
    """A tqdm bar fed by ``progress(done, total)``, shown only on a terminal for `min_bytes` or more."""

    def __init__(self, description: str, *, stream: TextIO | None = None, min_bytes: int = PROGRESS_MIN_BYTES) -> None:
        self.description, self.min_bytes = description, min_bytes
        self.stream = stream or sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.enabled = False
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        if self.bar is None:
            from tqdm import tqdm

            bar = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "dynamic_ncols": True}
            self.bar = tqdm(total=total, desc=self.description, file=self.stream, **bar)
        if done < self.bar.n or total != self.bar.total:
            self.bar.reset(total=total)  # the transfer started over
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; its exit status, or 1 with a one-line message for an error a user can act on."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or os.environ.get("WEIGHTSERVER_LOG_LEVEL") or "info").lower()
    if level not in LOG_LEVELS:
        parser.error(f"$WEIGHTSERVER_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    log_format = (args.log_format or os.environ.get("WEIGHTSERVER_LOG_FORMAT") or "text").lower()
    if log_format not in LOG_FORMATS:
        parser.error(f"$WEIGHTSERVER_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    configure_logging(level, log_format)
    try:
        args.handler(args)
    except (WeightServerError, OSError, ValueError) as exc:
        kind = f"{type(exc).__name__}: " if isinstance(exc, WeightServerError) else ""
        print(f"weightserver {args.command}: {kind}{exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
