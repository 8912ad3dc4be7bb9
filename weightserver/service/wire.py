"""Request decoding that turns a message that does not parse into INVALID_ARGUMENT, not INTERNAL."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from weightserver.protocol.errors import InvalidRequest


@dataclass(frozen=True)
class Undecodable:
    """A request that did not parse, handed to the handler in its place: raised in gRPC's
    deserializer, the error would end the call with INTERNAL, as if the server had failed."""

    message_type: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"a {self.message_type} message could not be parsed ({self.reason}); text fields (model names, "
            "publish ids, upload ids, metadata) must be valid UTF-8, and a publish id 1-128 printable ASCII "
            "characters without spaces"
        )


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer for `message_class` that returns an Undecodable instead of raising."""

    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_class.__name__, str(exc).rpartition(": ")[2] or "malformed")

    return deserialize
