"""The docs site builds with `mkdocs build --strict`: a broken link or anchor, a page missing from
the nav, a docstring mkdocstrings cannot read or a reference part that fails to generate fails
the test command, with MkDocs' own output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor
    result = subprocess.run(
        [*command, "--site-dir", str(site)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    for page in ("reference/errors", "reference/cli", "reference/configuration", "reference/python-api"):
        assert (site / page / "index.html").is_file(), page
    errors_page = (site / "reference" / "errors" / "index.html").read_text()
    assert "VersionEvicted" in errors_page and "<!-- generated" not in errors_page


def test_the_readmes_links_reach_files_of_the_repository() -> None:
    """README.md is not part of the site, so MkDocs does not check it: its relative links (into
    docs/, mostly) must name files that exist."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    local = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert len(local) > 20
    assert [link for link in local if not (REPO / link).exists()] == []
