"""Domain exceptions and the one table that maps them to gRPC status codes.

Exception tree::

    WeightServerError
    ├── NotFoundError                      NOT_FOUND
    │   ├── ModelNotFound                  the model has no versions
    │   ├── VersionNotFound                that version was never committed or was deleted
    │   ├── VersionEvicted                 the version fell out of the --keep window
    │   └── UploadNotFound                 a publish names an upload that is unknown, used or expired
    ├── InvalidRequest                     INVALID_ARGUMENT
    │   ├── InvalidModelName               empty, too long, path separators, '..'
    │   ├── InvalidSafetensors             the uploaded bytes are not a valid safetensors file
    │   └── VersionTooLarge                a requested version number above 2^63-1
    ├── IntegrityError                     DATA_LOSS (size or digest mismatch)
    ├── ModelTooLarge                      RESOURCE_EXHAUSTED (over --max-model-bytes)
    ├── StorageFull                        RESOURCE_EXHAUSTED (no space left in --data-dir)
    ├── DescriptionTooLarge                RESOURCE_EXHAUSTED (tensor list + metadata over 1 MiB)
    ├── TooManyUploads                     RESOURCE_EXHAUSTED (bulk/shm uploads set up and not yet used)
    ├── VersionConflict                    FAILED_PRECONDITION (version not above the latest)
    ├── NotPrimary                         FAILED_PRECONDITION (a relay takes no publish, delete or pin)
    ├── CursorOutOfRange                   OUT_OF_RANGE (a version ahead of the latest)
    ├── AuthenticationRequired             UNAUTHENTICATED (no or unknown bearer token)
    ├── PermissionDenied                   PERMISSION_DENIED (the token's role is too small)
    ├── ServerUnavailable                  UNAVAILABLE (client side: server unreachable)
    ├── DeadlineExceeded                   DEADLINE_EXCEEDED
    ├── Cancelled                          CANCELLED
    ├── PublishAborted                     ABORTED (an incoming publish followed by cut-through failed)
    └── InternalServerError                INTERNAL / UNKNOWN / anything else

The server aborts a call with the code from `STATUS_CODES` and the class name in the trailer
`weightserver-error`; the client rebuilds the type from that name, or from the code alone (never
from message text). Codes are names, so the store raises these without importing grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

ERROR_METADATA_KEY = "weightserver-error"
CLIENT_ID_METADATA_KEY = "weightserver-client-id"  # a client's name in the server's logs and metrics
# A status message travels in the trailers, which clients cap (gRPC: 8 KiB; from 8 to 16 KiB a
# random share of calls fail with RESOURCE_EXHAUSTED): messages quote input cut, and are cut.
MAX_STATUS_MESSAGE_BYTES = 1024


def clipped_repr(value: object, limit: int = 100) -> str:
    """`value`'s repr cut to `limit` characters, with its length when longer: `'xxxxxxx...(1000 chars)`."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} chars" if isinstance(value, str) else f"{len(text)} chars written out"
    return f"{text[:limit]}...({size})"


def clipped_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """`message` in at most `limit` UTF-8 bytes: the server's last guard on what it sends."""
    encoded = message.encode()
    if len(encoded) <= limit:
        return message
    tail = f"...(message cut from {len(encoded)} bytes)"
    return encoded[: limit - len(tail)].decode("utf-8", "ignore") + tail


class WeightServerError(Exception):
    """Base class of every error weightserver and its clients raise on purpose."""


class NotFoundError(WeightServerError):
    """A model or version that the server does not hold."""


class ModelNotFound(NotFoundError):
    """The model has no versions on this server."""


class VersionNotFound(NotFoundError):
    """The version was never committed, or was deleted."""


class VersionEvicted(NotFoundError):
    """The version existed but is older than the retained window (--keep)."""


class UploadNotFound(NotFoundError):
    """A Publish names an upload (NegotiateResponse.upload) never set up, used, or expired."""


class InvalidRequest(WeightServerError):
    """A request the server cannot act on as sent."""


class InvalidModelName(InvalidRequest):
    """A model name that is empty, too long, or could escape the data directory."""


class InvalidSafetensors(InvalidRequest):
    """Published bytes that are not a well-formed safetensors file."""


class VersionTooLarge(InvalidRequest):
    """A requested version number above the largest one the server hands out (2^63-1)."""


class IntegrityError(WeightServerError):
    """The bytes received do not match their declared size or sha256."""


class ModelTooLarge(WeightServerError):
    """A version larger than the server accepts (--max-model-bytes)."""


class StorageFull(WeightServerError):
    """The data directory has no space left for a version (or a manifest)."""


class DescriptionTooLarge(WeightServerError):
    """A version whose description (tensor list, metadata) clients could not receive."""


class TooManyUploads(WeightServerError):
    """Too many publishes over bulk or shared memory were set up (Negotiate) and not yet used."""


class VersionConflict(WeightServerError):
    """A requested version number that is not greater than the model's latest."""


class NotPrimary(WeightServerError):
    """A publish, delete or pin sent to a relay; the message names the primary."""


class CursorOutOfRange(WeightServerError):
    """A caller's version cursor is ahead of the model's latest version."""


class AuthenticationRequired(WeightServerError):
    """The server needs a bearer token and got none, or one it does not know."""


class PermissionDenied(WeightServerError):
    """The caller's token does not carry the role this call needs."""


class ServerUnavailable(WeightServerError):
    """The server could not be reached (down, restarting, wrong address)."""


class DeadlineExceeded(WeightServerError):
    """The call did not finish within its deadline."""


class Cancelled(WeightServerError):
    """The call was cancelled before it finished."""


class PublishAborted(WeightServerError):
    """An incoming publish that a cut-through fetch followed failed: no version."""


class InternalServerError(WeightServerError):
    """A failure inside the server; its log has the details."""


# The one table: exception -> grpc.StatusCode name. The first class listed for a code is what
# a client raises when it knows only the code.
STATUS_CODES: dict[type[WeightServerError], str] = {
    **dict.fromkeys((NotFoundError, ModelNotFound, VersionNotFound, VersionEvicted, UploadNotFound), "NOT_FOUND"),
    **dict.fromkeys((InvalidRequest, InvalidModelName, InvalidSafetensors, VersionTooLarge), "INVALID_ARGUMENT"),
    IntegrityError: "DATA_LOSS",
    **dict.fromkeys((ModelTooLarge, StorageFull, DescriptionTooLarge, TooManyUploads), "RESOURCE_EXHAUSTED"),
    **dict.fromkeys((VersionConflict, NotPrimary), "FAILED_PRECONDITION"),
    CursorOutOfRange: "OUT_OF_RANGE",
    AuthenticationRequired: "UNAUTHENTICATED",
    PermissionDenied: "PERMISSION_DENIED",
    ServerUnavailable: "UNAVAILABLE",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    Cancelled: "CANCELLED",
    PublishAborted: "ABORTED",
    InternalServerError: "INTERNAL",
}

_BY_NAME: dict[str, type[WeightServerError]] = {cls.__name__: cls for cls in STATUS_CODES}
_BY_CODE: dict[str, type[WeightServerError]] = {code: cls for cls, code in reversed(STATUS_CODES.items())}


def status_code_for(error: WeightServerError) -> grpc.StatusCode:
    """The status code of `error`'s class (or of its nearest listed base class)."""
    import grpc

    name = next((STATUS_CODES[cls] for cls in type(error).__mro__ if cls in STATUS_CODES), "INTERNAL")
    return grpc.StatusCode[name]  # type: ignore[index]


def error_from_status(code: grpc.StatusCode, message: str, error_name: str | None = None) -> WeightServerError:
    """Rebuild the domain exception for a failed call from its status and error name."""
    cls = _BY_NAME.get(error_name or "")
    if cls is None or STATUS_CODES[cls] != code.name:
        cls = _BY_CODE.get(code.name, InternalServerError)
    return cls(message)
