"""The docs' code examples run: every ```python block right after a `<!-- run -->` line, in
README.md and docs/, against a real server on a free loopback port. A page's blocks run in order
in one namespace (a later block uses what an earlier one made); `localhost:50051` in them is
rewritten to the test server's address. Blocks without the line are not run (they need a
cluster, torchrl collectors, or wait for events forever)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"^<!-- run -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# Pages whose main examples must run: a marker dropped by mistake fails here.
AT_LEAST = {"README.md": 1, "docs/guides/python.md": 4}


def runnable_blocks(text: str) -> list[str]:
    return RUNNABLE.findall(text)


def _pages_with_examples() -> list[str]:
    return [p.relative_to(REPO).as_posix() for p in PAGES if runnable_blocks(p.read_text())]


def test_the_runner_finds_the_marked_blocks():
    found = {page: len(runnable_blocks((REPO / page).read_text())) for page in _pages_with_examples()}
    for page, count in AT_LEAST.items():
        assert found.get(page, 0) >= count, f"{page}: {found.get(page, 0)} runnable blocks, expected >= {count}"
    assert runnable_blocks("<!-- run -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n") == ["x = 1\n"]


@pytest.mark.parametrize("page", _pages_with_examples())
def test_the_examples_run(page: str, make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from weightclient import WeightServiceClient

    server = make_server()
    monkeypatch.setenv("WEIGHTSERVER_ADDRESS", server.address)
    namespace: dict[str, object] = {"__name__": f"docs_example_{Path(page).stem}"}
    try:
        for number, block in enumerate(runnable_blocks((REPO / page).read_text()), start=1):
            source = block.replace("localhost:50051", server.address)
            try:
                exec(compile(source, f"{page} (block {number})", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{page}, runnable block {number} failed:\n{source}") from exc
    finally:
        for value in namespace.values():
            if isinstance(value, WeightServiceClient):
                value.close()
