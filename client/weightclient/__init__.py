"""Python client for weightserver: `WeightClient` (torch tensors, the `client` extra) and
`WeightServiceClient` (safetensors bytes, no torch), and the library's exception tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightclient.core.service_client import FetchedBytes, WeightServiceClient, default_address
from weightserver.protocol.errors import (
    AuthenticationRequired,
    Cancelled,
    CursorOutOfRange,
    DeadlineExceeded,
    DescriptionTooLarge,
    IntegrityError,
    InternalServerError,
    InvalidModelName,
    InvalidRequest,
    InvalidSafetensors,
    ModelNotFound,
    ModelTooLarge,
    NotFoundError,
    NotPrimary,
    PermissionDenied,
    PublishAborted,
    ServerUnavailable,
    StorageFull,
    TooManyUploads,
    UploadNotFound,
    VersionConflict,
    VersionEvicted,
    VersionNotFound,
    VersionTooLarge,
    WeightServerError,
)
from weightserver.protocol.selection import LLAMA_PLAN, Selection, TensorRule, tensor_parallel
from weightserver.protocol.version_info import IncomingEvent, ModelSummary, VersionEvent, VersionInfo

if TYPE_CHECKING:
    from weightclient.client import FetchResult, WeightClient

__all__ = [
    "LLAMA_PLAN",
    "AuthenticationRequired",
    "Cancelled",
    "CursorOutOfRange",
    "DeadlineExceeded",
    "DescriptionTooLarge",
    "FetchResult",
    "FetchedBytes",
    "IncomingEvent",
    "IntegrityError",
    "InternalServerError",
    "InvalidModelName",
    "InvalidRequest",
    "InvalidSafetensors",
    "ModelNotFound",
    "ModelSummary",
    "ModelTooLarge",
    "NotFoundError",
    "NotPrimary",
    "PermissionDenied",
    "PublishAborted",
    "Selection",
    "ServerUnavailable",
    "StorageFull",
    "TensorRule",
    "TooManyUploads",
    "UploadNotFound",
    "VersionConflict",
    "VersionEvent",
    "VersionEvicted",
    "VersionInfo",
    "VersionNotFound",
    "VersionTooLarge",
    "WeightClient",
    "WeightServerError",
    "WeightServiceClient",
    "default_address",
    "tensor_parallel",
]


def __getattr__(name: str) -> Any:
    # The torch-backed client loads on first use, so byte-level users never import torch.
    if name in ("WeightClient", "FetchResult"):
        from weightclient import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightclient' has no attribute {name!r}")
