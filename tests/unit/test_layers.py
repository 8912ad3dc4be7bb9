"""The package layers: the client loads only the protocol core of the server package, the core
imports neither side, the server never imports the client, and serving never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_server_cli_and_byte_client_do_not_import_torch():
    code = (
        "import sys\n"
        "import weightserver, weightserver.cli, weightserver.server, weightserver.service.servicer\n"
        "import weightclient, weightclient.core.service_client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


CORE = ("weightserver", "weightserver.v1", "weightserver.protocol")
# The composition roots: the console script and the relay (a client of its upstream) import
# both sides; nothing else of the server package may import the client.
COMPOSERS = ("weightserver.cli", "weightserver.relay", "weightserver.__main__")


def _loaded(code: str) -> list[str]:
    """The weightserver/weightclient modules a fresh interpreter has loaded after `code`."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [m for m in out if m.split(".")[0] in ("weightserver", "weightclient")]


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_client_loads_only_the_protocol_core():
    loaded = _loaded("import weightclient, weightclient.core.service_client, weightclient.transports")
    server_side = [m for m in loaded if m.startswith("weightserver") and m not in CORE and not _within(m, CORE[1:])]
    assert server_side == []
    assert "weightserver.protocol.errors" in loaded  # the check sees the core it allows


def test_the_protocol_core_imports_neither_side():
    code = (
        "import importlib, pkgutil, weightserver.protocol\n"
        "for m in pkgutil.walk_packages(weightserver.protocol.__path__, 'weightserver.protocol.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    loaded = _loaded(code)
    assert [m for m in loaded if m not in CORE and not _within(m, CORE[1:])] == []


def test_the_server_never_imports_the_client():
    """Only the composition roots (the console script, the relay) import weightclient."""
    code = (
        "import importlib, pkgutil, weightserver\n"
        "for m in pkgutil.walk_packages(weightserver.__path__, 'weightserver.'):\n"
        f"    if not m.name.startswith({COMPOSERS!r}):\n"
        "        importlib.import_module(m.name)\n"
    )
    assert [m for m in _loaded(code) if m.startswith("weightclient")] == []
    root = Path(__file__).parents[2] / "weightserver"
    importers = {
        str(p.relative_to(root.parent)).removesuffix(".py").replace("/", ".")
        for p in root.rglob("*.py")
        if "import weightclient" in p.read_text() or "from weightclient" in p.read_text()
    }
    assert {m for m in importers if not _within(m, COMPOSERS)} == set()


def test_version_store_imports_no_grpc():
    """The store is plain Python: unit-testable and reusable without gRPC."""
    code = (
        "import sys\n"
        "from weightserver.storage.store import VersionStore\n"
        "from weightserver.protocol.errors import STATUS_CODES\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pyproject_lists_every_package():
    """An installed (non-editable) wheel, as the Docker image builds, holds only the listed
    packages: a subpackage missing from the list is missing from the image."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, directory in setuptools["package-dir"].items():
        for init in (root / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(root / directory).parts
            found.add(".".join((name, *relative)))
    assert sorted(setuptools["packages"]) == sorted(found)


def test_the_relay_is_a_client_of_its_upstream():
    """Issue 28: the relay follows its upstream through the client core, with no generated
    stubs (a second gRPC client) of its own."""
    sources = {p.name: p.read_text() for p in (Path(__file__).parents[2] / "weightserver" / "relay").glob("*.py")}
    assert any("from weightclient.core" in text for text in sources.values())
    assert [name for name, text in sources.items() if "weightserver.v1" in text or "import grpc\n" in text] == []
