"""The one error table: every domain exception has a status code and survives the trip
server -> status + trailer -> client."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import grpc
import pytest

from weightserver.protocol import errors


def _all_error_classes() -> list[type[errors.WeightServerError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.WeightServerError) and cls is not errors.WeightServerError
    ]


def test_every_exception_is_in_the_table():
    assert set(_all_error_classes()) == set(errors.STATUS_CODES)


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_round_trip_through_status_and_name(cls):
    code = errors.status_code_for(cls("boom"))
    assert isinstance(code, grpc.StatusCode)
    rebuilt = errors.error_from_status(code, "boom", cls.__name__)
    assert type(rebuilt) is cls and str(rebuilt) == "boom"


def test_code_alone_picks_the_general_class():
    assert type(errors.error_from_status(grpc.StatusCode.NOT_FOUND, "x")) is errors.NotFoundError
    assert type(errors.error_from_status(grpc.StatusCode.UNAVAILABLE, "x")) is errors.ServerUnavailable
    assert type(errors.error_from_status(grpc.StatusCode.UNIMPLEMENTED, "x")) is errors.InternalServerError


def test_a_name_that_disagrees_with_the_code_is_ignored():
    rebuilt = errors.error_from_status(grpc.StatusCode.DATA_LOSS, "x", "ModelNotFound")
    assert type(rebuilt) is errors.IntegrityError


def _docs_error_rows() -> list[tuple[str, str, str]]:
    """(situation, status, client raises) of each row of the hand-written table "When each is
    raised" of docs/reference/errors.md, with the backticks around the status and the exception
    name taken off. (The page's table of every error is generated from STATUS_CODES.)"""
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "errors.md").read_text()
    section = page.split("\n## When each is raised\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| situation")]
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    assert cells and all(len(row) == 3 for row in cells), rows
    return [(situation, status.strip("`"), name.strip("`")) for situation, status, name in cells]


def test_the_docs_error_situations_list_every_exception_with_its_status_code():
    rows = _docs_error_rows()
    listed = {(name, status) for _, status, name in rows}
    missing = [
        f"{cls.__name__} ({code})" for cls, code in errors.STATUS_CODES.items() if (cls.__name__, code) not in listed
    ]
    assert not missing, f"docs/reference/errors.md's situations have no row for {', '.join(missing)}"
    by_name = {cls.__name__: code for cls, code in errors.STATUS_CODES.items()}
    wrong = [f"{name}: {status}" for _, status, name in rows if by_name.get(name) != status]
    assert not wrong, f"docs/reference/errors.md's situations name an unknown exception or the wrong code: {wrong}"


def test_the_docstring_tree_draws_the_hierarchy_and_the_codes():
    """errors.py's docstring draws every exception under its real base class, with its code."""
    drawn: dict[str, tuple[int, str]] = {}  # name -> (depth, first word after it)
    parents: list[str] = []
    for line in errors.__doc__.split("Exception tree::", 1)[1].split("\n\n")[1].splitlines():
        match = re.match(r"^ *([│├└─ ]*)(\w+)\s*(\S*)", line)
        assert match, line
        depth = len(match[1]) // 4
        del parents[depth:]
        cls = getattr(errors, match[2])
        assert cls.__mro__[1].__name__ == (parents[-1] if parents else "Exception"), line
        parents.append(match[2])
        drawn[match[2]] = (depth, match[3])
    assert set(drawn) == {c.__name__ for c in errors.STATUS_CODES} | {"WeightServerError"}
    for cls, code in errors.STATUS_CODES.items():
        word = drawn[cls.__name__][1]
        if word.isupper() or cls.__mro__[1] is errors.WeightServerError:
            assert word == code, cls.__name__


def test_weightclient_exports_every_error_as_the_same_class():
    import weightclient

    for cls in [errors.WeightServerError, *errors.STATUS_CODES]:
        assert getattr(weightclient, cls.__name__) is cls
        assert cls.__name__ in weightclient.__all__
