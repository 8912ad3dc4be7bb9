"""Turns failed gRPC calls into weightserver's exception types (see weightserver.protocol.errors)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from weightserver.protocol.errors import ERROR_METADATA_KEY, WeightServerError, error_from_status


def error_from_rpc(err: grpc.RpcError) -> WeightServerError:
    """The domain exception for a failed call, chosen by status code and the server's error name."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return error_from_status(code, details, dict(trailing or ()).get(ERROR_METADATA_KEY))


@contextmanager
def translated_rpc_errors(address: str | None = None) -> Iterator[None]:
    """Re-raise grpc.RpcError inside the block as the matching WeightServerError subclass."""
    try:
        yield
    except grpc.RpcError as err:
        error = error_from_rpc(err)
        if address and err.code() == grpc.StatusCode.UNAVAILABLE:
            error = type(error)(f"weight server at {address} is unavailable: {error}")
        raise error from None
