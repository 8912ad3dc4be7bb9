"""How a call enters and leaves the service: decoding, authorization, status codes, its log line."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from weightserver.protocol.errors import (
    CLIENT_ID_METADATA_KEY,
    ERROR_METADATA_KEY,
    InvalidRequest,
    WeightServerError,
    clipped_message,
    status_code_for,
)

F = TypeVar("F", bound=Callable[..., Any])
# The servicer's logger, the name operators and tests filter publish and fetch lines on.
log = logging.getLogger("weightserver.service.servicer")
Context = grpc.aio.ServicerContext
CHANGES = {"Publish": "publishes", "DeleteVersion": "deletes", "PinVersion": "pins"}  # a relay refuses them


@dataclass(frozen=True)
class Undecodable:
    """A request that did not parse (raised in gRPC's deserializer, it would end the call INTERNAL)."""

    message_type: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"a {self.message_type} message could not be parsed ({self.reason}); text fields (model names, "
            "publish ids, upload ids, metadata) must be valid UTF-8, and a publish id 1-128 printable ASCII "
            "characters without spaces"
        )


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_class.__name__, str(exc).rpartition(": ")[2] or "malformed")

    return deserialize


async def abort(context: Context, error: BaseException) -> None:
    if isinstance(error, WeightServerError):
        code, name, message = status_code_for(error), type(error).__name__, str(error)
    else:
        log.exception("internal error in %s", context.peer())
        code, name = grpc.StatusCode.INTERNAL, "InternalServerError"
        message = f"internal server error ({type(error).__name__}); see the server log"
    # Clipped: an oversized status fails the call on the client with RESOURCE_EXHAUSTED instead.
    await context.abort(code, clipped_message(message), trailing_metadata=((ERROR_METADATA_KEY, name),))


def _admit(servicer: Any, request: Any, context: Context, method: str) -> None:
    # The model a call changes counts for model-scoped tokens; a Publish's headers are checked as they come.
    servicer.authorize(context, method, getattr(request, "model", None))
    if isinstance(request, Undecodable):
        raise request.error()
    if servicer.relay is not None and method in CHANGES:
        servicer.relay.refuse(CHANGES[method])


def unary(method: F) -> F:
    """Admit a unary call (token, decoding, relay); end it with the status of what it raises."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: Context) -> Any:
        try:
            _admit(self, request, context, method.__name__)
            return await method(self, request, context)
        except Exception as error:
            await abort(context, error)

    return handler  # type: ignore[return-value]


def streaming(method: F) -> F:
    """The same for a server-streaming call, closed as soon as the call ends."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: Context) -> AsyncIterator[Any]:
        try:
            _admit(self, request, context, method.__name__)
            async with contextlib.aclosing(method(self, request, context)) as messages:
                async for message in messages:
                    yield message
        except Exception as error:
            await abort(context, error)

    return handler  # type: ignore[return-value]


def log_event(event: str, context: Context, **fields: object) -> None:
    """Log `event` with `fields`; the record carries them, `peer` and `client_id` for --log-format json."""
    peer, client_id = context.peer(), client_id_of(context)
    pairs = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    extra = {"event": event, **fields, "peer": peer, "client_id": client_id}
    log.info("%s %s peer=%s client=%s", event, pairs, peer, client_id or "-", extra=extra)


def client_id_of(context: Context) -> str | None:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == CLIENT_ID_METADATA_KEY), None)
