"""The checked-in stubs in weightserver/v1 are exactly what scripts/gen_protos.py makes from
protos/: regenerate with `python scripts/gen_protos.py` after editing the proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_match_proto(tmp_path):
    _load_generator().generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is missing: run python scripts/gen_protos.py"
        assert checked_in.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} differs from protos/: run python scripts/gen_protos.py and commit the result"
        )


def test_every_rpc_and_field_is_commented():
    """The proto is a public contract: each rpc and each field carries a comment."""
    lines = (ROOT / "protos" / "weightserver" / "v1" / "weights.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_rpc = stripped.startswith("rpc ")
        is_field = (
            stripped.endswith(";")
            and "=" in stripped
            and not stripped.startswith(("option", "syntax", "package", "import", "//"))
        )
        if is_rpc or is_field:
            previous = lines[i - 1].strip()
            assert previous.startswith("//"), f"line {i + 1} has no comment: {stripped}"
