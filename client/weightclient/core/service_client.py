"""WeightServiceClient: the byte-level client of weightserver.v1.WeightService (no torch; the
CLI and the relay use it, `WeightClient` adds tensors), composed of one part per job."""

from __future__ import annotations

from weightclient.core.admin import Admin
from weightclient.core.failover import default_address
from weightclient.core.fetch import FetchedBytes, Fetching, FetchStats
from weightclient.core.publish import Publishing
from weightclient.core.watch import Watching

__all__ = ["FetchStats", "FetchedBytes", "WeightServiceClient", "default_address"]


class WeightServiceClient(Publishing, Fetching, Watching, Admin):
    """A connection to a weight server (or several, with failover) on safetensors bytes: publish,
    fetch, watch, describe and manage. Arguments: `core.failover.Connection`."""
