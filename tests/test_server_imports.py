"""The server side never imports torch: its image needs none and it starts fast."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_server_cli_and_byte_client_do_not_import_torch():
    code = (
        "import sys\n"
        "import weightserver, weightserver.cli, weightserver.server, weightserver.service\n"
        "import weightclient, weightclient.service_client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_server_never_imports_the_client():
    """No package cycle: every module of the server package loads without weightclient."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import weightserver\n"
        "for module in pkgutil.walk_packages(weightserver.__path__, 'weightserver.'):\n"
        "    if module.name != 'weightserver.__main__':\n"
        "        importlib.import_module(module.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'weightclient')\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    sources = Path(__file__).parents[1] / "weightserver"
    assert [p.name for p in sources.rglob("*.py") if "weightclient" in p.read_text()] == []


def test_version_store_imports_no_grpc():
    """The store is plain Python: unit-testable and reusable without gRPC."""
    code = (
        "import sys\n"
        "from weightserver.store import VersionStore\n"
        "from weightserver.errors import STATUS_CODES\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pyproject_lists_every_package():
    """An installed (non-editable) wheel, as the Docker image builds, holds only the listed
    packages: a subpackage missing from the list is missing from the image."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, directory in setuptools["package-dir"].items():
        for init in (root / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(root / directory).parts
            found.add(".".join((name, *relative)))
    assert sorted(setuptools["packages"]) == sorted(found)
