"""How the client turns a failed gRPC call into the domain error it raises."""

from __future__ import annotations

import grpc
import pytest

from weightclient.core.failover import map_rpc_errors
from weightserver.protocol.errors import InternalServerError, ServerUnavailable


class FailedCall(grpc.RpcError):
    """A failed call as gRPC raises it: with a status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_an_unavailable_server_is_named_by_its_address() -> None:
    unavailable = r"weight server at 10\.0\.0\.1:50051 is unavailable: connection refused"
    with pytest.raises(ServerUnavailable, match=unavailable), map_rpc_errors("10.0.0.1:50051"):
        raise FailedCall(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_an_rpc_error_without_a_status_is_a_domain_error_too() -> None:
    """grpc.RpcError itself has no code(): mapping one raised AttributeError when an address was given."""
    with pytest.raises(InternalServerError, match="no status"), map_rpc_errors("10.0.0.1:50051"):
        raise grpc.RpcError("no status")
