"""weightserver: a gRPC server for versioned model weights; it never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightserver.config import ServerConfig
    from weightserver.server import WeightServer
    from weightserver.storage.store import Version, VersionStore

__all__ = ["ServerConfig", "Version", "VersionStore", "WeightServer"]
__version__ = "0.1.0"

_EXPORTS = {
    "ServerConfig": "weightserver.config",
    "WeightServer": "weightserver.server",
    "Version": "weightserver.storage.store",
    "VersionStore": "weightserver.storage.store",
}


def __getattr__(name: str) -> Any:
    # Loaded on first use: importing weightserver.storage.store must not pull in grpc.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'weightserver' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
