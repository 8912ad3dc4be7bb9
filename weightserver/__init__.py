"""weightserver: a gRPC server for versioned model weights (trainer publishes, collectors fetch).

The server side never imports torch: it stores and validates safetensors bytes.
"""

from weightserver.config import ServerConfig
from weightserver.server import WeightServer
from weightserver.store import Version, VersionStore

__all__ = ["ServerConfig", "Version", "VersionStore", "WeightServer"]
__version__ = "0.1.0"
