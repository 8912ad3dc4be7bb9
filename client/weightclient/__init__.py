"""Python client for weightserver: `WeightClient` (torch tensors, the `client` extra) and
`WeightServiceClient` (safetensors bytes, no torch). Every exception of the library's tree
(`weightserver.protocol.errors`) is exported here too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightclient.core.service_client import FetchedBytes, WeightServiceClient, default_address
from weightserver.protocol import errors as _errors
from weightserver.protocol.version_info import ModelSummary, VersionEvent, VersionInfo

if TYPE_CHECKING:
    from weightclient.client import FetchResult, WeightClient

_EXCEPTIONS = {cls.__name__: cls for cls in (_errors.WeightServerError, *_errors.STATUS_CODES)}
globals().update(_EXCEPTIONS)
__all__ = [
    *sorted(_EXCEPTIONS),
    "FetchResult",
    "FetchedBytes",
    "ModelSummary",
    "VersionEvent",
    "VersionInfo",
    "WeightClient",
    "WeightServiceClient",
    "default_address",
]


def __getattr__(name: str) -> Any:
    # The torch-backed client loads on first use, so byte-level users never import torch.
    if name in ("WeightClient", "FetchResult"):
        from weightclient import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightclient' has no attribute {name!r}")
