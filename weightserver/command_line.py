"""The `weightserver` console script (also `python -m weightclient`): weightserver.cli's `serve`
and the client's publish, fetch, ls, watch, delete and pin (through WeightServiceClient, which
reads `WEIGHTSERVER_ADDRESS`, `WEIGHTSERVER_TOKEN` and `WEIGHTSERVER_TLS_*`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from weightclient.core.service_client import WeightServiceClient
from weightserver.cli import command_parser, run_command
from weightserver.protocol.errors import ModelNotFound
from weightserver.protocol.limits import MiB
from weightserver.protocol.version_info import VersionInfo

if TYPE_CHECKING:
    from tqdm import tqdm

Handler = Callable[[argparse.Namespace], int]
PROGRESS_MIN_BYTES = 8 * MiB


def parse_meta(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"invalid metadata {text!r}: use KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The whole `weightserver` command line: `serve` and the client's commands."""
    parser, commands = command_parser()

    def client_command(name: str, help_text: str, handler: Handler, *, model: bool = True) -> argparse.ArgumentParser:
        """A client command with the connection options, and a required --model unless `model` is False."""
        sub = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        sub.set_defaults(handler=handler)
        sub.add_argument(
            "--server", help="host:port of the server (default: $WEIGHTSERVER_ADDRESS, else localhost:50051)"
        )
        sub.add_argument(
            "--token-file",
            type=Path,
            help="read the bearer token from this file (default: $WEIGHTSERVER_TOKEN, if set)",
        )
        sub.add_argument(
            "--tls-ca",
            type=Path,
            metavar="PEM",
            help="connect with TLS, trusting this CA (default: $WEIGHTSERVER_TLS_CA; plaintext if neither)",
        )
        sub.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mutual TLS)")
        sub.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
        if model:
            sub.add_argument("--model", required=True, help="model name, e.g. policy")
        return sub

    publish = client_command(
        "publish", "publish a .safetensors file as a new version and print its number", cmd_publish
    )
    publish.add_argument("file", type=Path, help="a .safetensors file")
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

    fetch = client_command("fetch", "fetch a version into a .safetensors file", cmd_fetch)
    fetch.add_argument("--version", dest="version_number", type=int, help="exact version (default: latest)")
    fetch.add_argument("-o", "--output", type=Path, required=True, help="file to write")

    ls = client_command("ls", "list models, or the versions of one model", cmd_ls, model=False)
    ls.add_argument("--model", help="list this model's versions and tensors")
    ls.add_argument("--json", action="store_true", help="print JSON")

    watch = client_command("watch", "print a line for every new version of a model until interrupted", cmd_watch)
    watch.add_argument(
        "--since", type=int, help="last version you know; older retained versions are printed first (default: latest)"
    )
    watch.add_argument("--json", action="store_true", help="print one JSON object per version")

    delete = client_command("delete", "delete one version", cmd_delete)
    delete.add_argument("--version", dest="version_number", type=int, required=True, help="version to delete")

    pin = client_command("pin", "pin a version so --keep never evicts it (or --unpin)", cmd_pin)
    pin.add_argument("--version", dest="version_number", type=int, required=True, help="version to pin")
    pin.add_argument("--unpin", action="store_true", help="unpin instead")
    return parser


# ---------------------------------------------------------------------- commands
def _client(args: argparse.Namespace) -> WeightServiceClient:
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
            records = [m.__dict__ for m in models]
            headers = ["MODEL", "LATEST", "VERSIONS", "BYTES"]
            rows = [[m.model, m.latest_version, m.version_count, m.retained_bytes] for m in models]
        else:
            versions = client.list_versions(args.model)
            records = [_info_json(v) for v in versions]
            headers = ["VERSION", "CREATED", "BYTES", "TENSORS", "PINNED", "SHA256", "METADATA"]
            rows = [
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
            ]
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        _table(headers, rows)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
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


class TransferProgress:
    """A tqdm bar on `stream` (stderr) driven by ``progress(done, total)`` calls, shown only on a
    terminal and for transfers of at least `min_bytes`; `bar` is None while none is shown.

    >>> import io
    >>> with TransferProgress("fetch", stream=io.StringIO()) as progress:
    ...     progress(16 * MiB, 16 * MiB)
    >>> progress.bar is None
    True
    """

    def __init__(self, description: str, *, stream: TextIO | None = None, min_bytes: int = PROGRESS_MIN_BYTES) -> None:
        self.description = description
        self.stream = stream or sys.stderr
        self.min_bytes = min_bytes
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

            self.bar = tqdm(
                total=total,
                desc=self.description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                dynamic_ncols=True,
            )
        if done < self.bar.n or total != self.bar.total:
            self.bar.reset(total=total)  # the transfer started over
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The `weightserver` console script."""
    parser = build_parser()
    return run_command(parser, parser.parse_args(argv))
