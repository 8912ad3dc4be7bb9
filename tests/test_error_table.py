"""The one error table: every domain exception has a status code and survives the trip
server -> status + trailer -> client."""

from __future__ import annotations

import inspect

import grpc
import pytest

from weightserver import errors


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
