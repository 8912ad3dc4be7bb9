"""`weightserver serve`, and the command-line parts every `weightserver` command shares.

`python -m weightserver` runs `main` here: the server's one command, `serve`. The client's
commands (publish, fetch, ls, watch, delete, pin) are in the client package's command line,
which the installed `weightserver` console script runs: it builds on `command_parser` and
`run_command`, so `serve` is the same command either way. The server never imports the client;
asked for a client command, `python -m weightserver` says where to find it.

`WEIGHTSERVER_LOG_LEVEL` and `WEIGHTSERVER_LOG_FORMAT` are read here (`run_command`) and nowhere
else; so is `WEIGHTSERVER_UPSTREAM_TOKEN`, a relay's token for its upstream (`server_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from weightserver import __version__
from weightserver.config import ServerConfig
from weightserver.logs import LOG_FORMATS, configure_logging
from weightserver.protocol.errors import WeightServerError
from weightserver.protocol.limits import DEFAULT_CHUNK_BYTES, DEFAULT_PORT

log = logging.getLogger("weightserver")

# A relay's bearer token for its upstream, when --upstream-token-file is not given: a secret
# kept out of the process list (a Kubernetes Secret as an environment variable, say).
UPSTREAM_TOKEN_ENV = "WEIGHTSERVER_UPSTREAM_TOKEN"
# The console script's commands besides `serve`, all from the client package.
CLIENT_COMMANDS = ("publish", "fetch", "ls", "watch", "delete", "pin")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
# "", "B", then K/M/G/T alone or with "B" (powers of 1000) and with "iB" (powers of 1024).
_UNITS = {"": 1, "B": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("KMGT", start=1)
    for suffix, base in (("", 1000), ("B", 1000), ("IB", 1024))
}


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '4096' -> 4096."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").upper() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a unit, e.g. 512MiB, 2GiB, 1GB")
    return int(float(match.group(1)) * _UNITS[unit])


def _model_list(text: str) -> tuple[str, ...]:
    """'policy,critic' -> ('policy', 'critic')."""
    models = tuple(name.strip() for name in text.split(",") if name.strip())
    if not models:
        raise argparse.ArgumentTypeError(f"invalid model list {text!r}: name them with commas, e.g. policy,critic")
    return models


def command_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    """The `weightserver` parser with its global options and the `serve` command, and its
    subcommands, to which the console script adds the client's."""
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
        "--data-dir", type=Path, help="directory to persist versions in; without it they live in memory only"
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
        dest="grace_seconds",
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
        "--bulk-max-connections",
        type=int,
        default=ServerConfig.bulk_max_connections,
        metavar="N",
        help="connections the bulk port keeps open at once; one more is closed at once and that "
        "client fetches over the gRPC stream (default: %(default)s)",
    )
    serve.add_argument(
        "--shm-dir",
        type=Path,
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
        metavar="FILE",
        help="require bearer tokens listed in FILE, one 'ROLE NAME TOKEN' per line; roles: reader "
        "(fetch/watch/list), publisher (+ publish), admin (+ delete/pin); 'publisher:a,b' or 'admin:a,b' "
        "may change only models a and b. Health checks need none",
    )
    serve.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate chain")
    serve.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca",
        type=Path,
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
        "--max-stream-fetches",
        type=int,
        default=ServerConfig.max_stream_fetches,
        metavar="N",
        help="gRPC stream fetches sending chunks at once; more wait their turn, so that many fetchers "
        "cannot starve publishes; raise it for collectors on slow links (default: one per CPU, at least 2: "
        "%(default)s)",
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
        metavar="PORT",
        help="serve Prometheus metrics over plain HTTP at http://HOST:PORT/metrics, 0 for a free port (default: off)",
    )
    serve.add_argument(
        "--port-file", type=Path, help="write the bound port to this file once serving (useful with --port 0)"
    )
    serve.add_argument(
        "--upstream",
        metavar="ADDRESS",
        help="run as a relay of the server at ADDRESS (host:port, a primary or another relay): fetch each of "
        "its versions once and serve them under the same numbers, metadata and digests; publishes, deletes "
        "and pins are refused with FAILED_PRECONDITION naming the primary (default: off, a primary)",
    )
    serve.add_argument(
        "--models",
        dest="upstream_models",
        type=_model_list,
        metavar="A,B",
        help="with --upstream: follow only these models (default: every model the upstream has, "
        "including ones that appear later)",
    )
    serve.add_argument(
        "--upstream-poll",
        dest="upstream_poll_seconds",
        type=float,
        default=ServerConfig.upstream_poll_seconds,
        metavar="SECONDS",
        help="with --upstream: how often to list the upstream's models, to find new ones and to tell "
        "whether it is up (default: %(default)s)",
    )
    serve.add_argument(
        "--upstream-token-file",
        type=Path,
        metavar="FILE",
        help=f"with --upstream: send the bearer token in FILE with every call to the upstream, for an "
        f"upstream started with --auth-tokens (its file must list it with role reader or above) "
        f"(default: ${UPSTREAM_TOKEN_ENV}, if set)",
    )
    serve.add_argument(
        "--upstream-tls",
        action="store_true",
        help="with --upstream: dial the upstream over TLS, trusting the system's root certificates "
        "(implied by --upstream-tls-ca, --upstream-tls-cert and --upstream-tls-key)",
    )
    serve.add_argument(
        "--upstream-tls-ca",
        type=Path,
        metavar="PEM",
        help="with --upstream: dial the upstream over TLS, trusting the CA in PEM (the one that signed "
        "the upstream's --tls-cert)",
    )
    serve.add_argument(
        "--upstream-tls-cert",
        type=Path,
        metavar="PEM",
        help="with --upstream: present this client certificate to an upstream that demands one "
        "(--tls-client-ca, mutual TLS); needs --upstream-tls-key",
    )
    serve.add_argument("--upstream-tls-key", type=Path, metavar="PEM", help="private key of --upstream-tls-cert")
    serve.set_defaults(handler=cmd_serve)
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m weightserver`: `serve`, and the client's command names, unlisted
    in --help, each answering where the command is run."""
    parser, commands = command_parser()
    for name in CLIENT_COMMANDS:
        # No word after the name looks like an option to this parser (no prefix character
        # matches), so whatever the caller typed is taken and ignored.
        elsewhere = commands.add_parser(name, add_help=False, prefix_chars="\0")
        elsewhere.add_argument("ignored", nargs="*")
        elsewhere.set_defaults(handler=_client_command)
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
def server_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """The ServerConfig of parsed `serve` options (ValueError for a combination it refuses);
    a relay's upstream token from --upstream-token-file, else $WEIGHTSERVER_UPSTREAM_TOKEN in
    `environ` (read only for a relay)."""
    # Options are stored under their ServerConfig field's names; these three need translating.
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    options["bulk_port"] = None if args.no_bulk else args.bulk_port
    options["shm_dir"] = None if args.no_shm else (args.shm_dir or "auto")
    options["publish_timeout"] = args.publish_timeout or None
    options["upstream_token"] = _upstream_token(args, environ)
    return ServerConfig(**options)


def _upstream_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    path = getattr(args, "upstream_token_file", None)
    if path is not None:
        try:
            return path.read_text()
        except OSError as exc:
            raise ValueError(f"--upstream-token-file {path}: {exc.strerror}") from None
    if args.upstream is None:  # a primary's environment may hold it for other programs: not read
        return None
    return environ.get(UPSTREAM_TOKEN_ENV) or None


def cmd_serve(args: argparse.Namespace) -> int:
    """Run a server with the parsed options until SIGTERM or SIGINT."""
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
    return 0


def _client_command(args: argparse.Namespace) -> int:
    print(
        f"weightserver {args.command}: a client command; `python -m weightserver` only serves. "
        f"Run it with the installed `weightserver` command: weightserver {args.command} ...",
        file=sys.stderr,
    )
    return 2


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Set up logging (from the options, else the environment) and run the parsed command's
    handler; its exit status, or 1 with a one-line message for an error a user can act on."""
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m weightserver`: run the server (the one command of this package)."""
    parser = build_parser()
    return run_command(parser, parser.parse_args(argv))
