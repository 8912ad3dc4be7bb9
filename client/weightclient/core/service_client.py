"""WeightServiceClient: the byte-level client (no torch; the CLI and the relay use it)."""

from __future__ import annotations

from weightclient.core.failover import default_address
from weightclient.core.fetch import FetchedBytes, Fetching, FetchStats
from weightclient.core.publish import Publishing
from weightclient.core.watch import Watching
from weightserver.protocol.version_info import ModelSummary, VersionInfo
from weightserver.v1 import weights_pb2 as pb

__all__ = ["FetchStats", "FetchedBytes", "WeightServiceClient", "default_address"]


class WeightServiceClient(Publishing, Fetching, Watching):
    """Publish, fetch, watch, describe and manage safetensors bytes. Arguments: `Connection`."""

    def latest(self, model: str, *, retry: bool = True, timeout: float | None = None) -> VersionInfo:
        request = pb.GetLatestRequest(model=model)
        return VersionInfo.from_proto(self._call("GetLatest", request, retry=retry, timeout=timeout))

    def describe(self, model: str, version: int = 0) -> VersionInfo:
        """`version` of `model` (0: the latest)."""
        return VersionInfo.from_proto(self._call("Describe", pb.DescribeRequest(model=model, version=version)))

    def list_models(self) -> list[ModelSummary]:
        return [ModelSummary.from_proto(m) for m in self._call("ListModels", pb.ListModelsRequest()).models]

    def list_versions(self, model: str) -> list[VersionInfo]:
        """Retained versions of `model`, oldest first."""
        reply = self._call("ListVersions", pb.ListVersionsRequest(model=model))
        return [VersionInfo.from_proto(v) for v in reply.versions]

    def delete(self, model: str, version: int) -> VersionInfo:
        reply = self._call("DeleteVersion", pb.DeleteVersionRequest(model=model, version=version), change=True)
        return VersionInfo.from_proto(reply.deleted)

    def pin(self, model: str, version: int, pinned: bool = True) -> VersionInfo:
        """Pin (keep beyond --keep) or unpin a version."""
        request = pb.PinVersionRequest(model=model, version=version, pinned=pinned)
        return VersionInfo.from_proto(self._call("PinVersion", request, change=True))
