"""The reference pages generated from the code (docs/reference_pages.py) list every error name,
every CLI option and every ServerConfig field; and the checks below notice when one is missing."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from weightserver.cli import build_parser
from weightserver.config import ServerConfig
from weightserver.protocol import errors

ROOT = Path(__file__).resolve().parents[2]


def _load_reference_pages():
    spec = importlib.util.spec_from_file_location("docs_reference_pages", ROOT / "docs" / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


reference_pages = _load_reference_pages()


def _rows(markdown: str) -> list[list[str]]:
    """The body rows of every markdown table in `markdown`, as cells (escaped pipes kept in)."""
    lines = markdown.splitlines()
    separator = re.compile(r"^\|(-+\|)+$")
    rows = []
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        if line.startswith("| ") and not separator.match(after):  # a header row has one after it
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _first_cells(markdown: str) -> list[str]:
    return [row[0] for row in _rows(markdown)]


# The checks ------------------------------------------------------------------------------


def missing_errors(markdown: str) -> list[str]:
    """Exceptions of the status table without a row giving their status code."""
    rows = {(row[0].strip("`"), row[1].strip("`")) for row in _rows(markdown) if len(row) >= 2}
    return [cls.__name__ for cls, code in errors.STATUS_CODES.items() if (cls.__name__, code) not in rows]


def _parser_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string (or a positional's name) of `parser`, walked here, not by the generator."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        found += action.option_strings or [action.dest]
    return found


def _sections(markdown: str) -> dict[str, str]:
    """'## weightserver X' section of the CLI page by command ("" for the global options)."""
    parts = re.split(r"^## weightserver ?(\w*)\n", markdown, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def missing_cli_options(markdown: str) -> list[str]:
    """`command --option` for every option of the real parser that its section's tables lack."""
    parser = build_parser()
    commands = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
    sections = _sections(markdown)
    missing = []
    for name, command in commands.items():
        listed = {option.strip("`") for cell in _first_cells(sections.get(name, "")) for option in cell.split(", ")}
        missing += [f"{name} {option}".strip() for option in _parser_options(command) if option not in listed]
    return missing


def missing_fields(markdown: str) -> list[str]:
    listed = {cell.strip("`") for cell in _first_cells(markdown)}
    return [field.name for field in dataclasses.fields(ServerConfig) if field.name not in listed]


def _without_row(markdown: str, first_cell: str) -> str:
    lines = markdown.splitlines()
    kept = [line for line in lines if not line.startswith(f"| {first_cell} |")]
    assert len(kept) == len(lines) - 1, f"no single row starts with {first_cell}"
    return "\n".join(kept)


# The pages -------------------------------------------------------------------------------


def test_the_errors_page_lists_every_error_with_its_status():
    page = reference_pages.errors_markdown()
    assert missing_errors(page) == []
    assert len(_rows(page)) == len(errors.STATUS_CODES)
    for cls in errors.STATUS_CODES:
        row = next(row for row in _rows(page) if row[0] == f"`{cls.__name__}`")
        assert row[3], f"{cls.__name__} has no meaning (its docstring)"


def test_the_cli_page_lists_every_command_and_option():
    page = reference_pages.cli_markdown()
    assert missing_cli_options(page) == []
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(_sections(page)) == {"", *commands}

    def arguments(command: argparse.ArgumentParser) -> int:  # an option's names share its row
        return sum(not isinstance(a, argparse._HelpAction | argparse._SubParsersAction) for a in command._actions)

    expected = arguments(parser) + sum(arguments(sub) for sub in commands.values())
    assert sum(len(_rows(section)) for section in _sections(page).values()) == expected
    assert all(row[2] for row in _rows(page)), "an option without help text"


def test_the_configuration_page_lists_every_field():
    page = reference_pages.configuration_markdown()
    assert missing_fields(page) == []
    assert len(_rows(page)) == len(dataclasses.fields(ServerConfig))
    for row in _rows(page):
        assert row[4] or row[5], f"{row[0]} has no description: neither option help nor a comment in config.py"


def test_the_configuration_page_names_the_options_that_set_each_field():
    by_field = {row[0].strip("`"): row[3] for row in _rows(reference_pages.configuration_markdown())}
    assert by_field["grace_seconds"] == "`--grace`"
    assert by_field["bulk_port"] == "`--bulk-port`, `--no-bulk`"
    assert by_field["shm_dir"] == "`--shm-dir`, `--no-shm`"
    assert by_field["upstream_token"] == "`--upstream-token-file`, `$WEIGHTSERVER_UPSTREAM_TOKEN`"
    assert by_field["max_tensors"] == "(no option)"


# The checks fail when a line is missing ------------------------------------------------


def test_a_missing_error_row_is_found():
    page = _without_row(reference_pages.errors_markdown(), "`VersionEvicted`")
    assert missing_errors(page) == ["VersionEvicted"]


def test_a_missing_option_row_is_found():
    page = _without_row(reference_pages.cli_markdown(), "`--upstream-tls-ca`")
    assert missing_cli_options(page) == ["serve --upstream-tls-ca"]
    page = _without_row(reference_pages.cli_markdown(), "`-o`, `--output`")
    assert missing_cli_options(page) == ["fetch -o", "fetch --output"]


def test_a_missing_field_row_is_found():
    page = _without_row(reference_pages.configuration_markdown(), "`payload_cache_bytes`")
    assert missing_fields(page) == ["payload_cache_bytes"]


# The pages that ask for them -------------------------------------------------------------


def test_every_generated_part_is_on_its_page_and_every_marker_is_known():
    markers = {}
    for path in (ROOT / "docs").rglob("*.md"):
        for name in reference_pages.MARKER.findall(path.read_text()):
            markers[name] = path.relative_to(ROOT / "docs").as_posix()
    assert markers == {
        "errors": "reference/errors.md",
        "cli": "reference/cli.md",
        "configuration": "reference/configuration.md",
    }
    with pytest.raises(KeyError, match="names no generator"):
        reference_pages.expand("<!-- generated: nothing -->")


def test_the_server_guides_flags_are_options_of_serve():
    """The hand-written table of docs/guides/server.md names no option that `serve` lacks."""
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    table = (ROOT / "docs" / "guides" / "server.md").read_text().split("| flag | default | meaning |", 1)[1]
    flags = re.findall(r"`(--[a-z-]+)`", "\n".join(row[0] for row in _rows(table.split("\n\n", 1)[0])))
    assert len(flags) > 20
    assert set(flags) - set(_parser_options(serve)) == set()
