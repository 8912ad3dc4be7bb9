"""WeightClient: publish and fetch torch weights (nn.Module, TensorDict, state dict)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from weightclient import tensor_codec
from weightclient.service_client import WeightServiceClient
from weightclient.version_info import VersionInfo
from weightserver.errors import NotFoundError
from weightserver.safetensors_format import parse_header


@dataclass(frozen=True)
class FetchResult:
    """A fetched version: `.version`, `.metadata`, `.weights` (TensorDict), `.state_dict()`.

    The tensors share one buffer holding the received bytes (no per-tensor copies).
    """

    info: VersionInfo
    tensors: dict[str, torch.Tensor] = field(repr=False)
    data: bytearray = field(repr=False)

    @property
    def version(self) -> int:
        return self.info.version

    @property
    def metadata(self) -> dict[str, str]:
        return self.info.metadata

    @property
    def weights(self) -> TensorDict:
        """A TensorDict keyed like the state dict ("0.weight"); `.unflatten_keys(".")` nests it."""
        return TensorDict(dict(self.tensors), batch_size=[])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A plain {name: tensor} dict, ready for `module.load_state_dict`."""
        return dict(self.tensors)


class WeightClient(WeightServiceClient):
    """Publish and fetch model weights as torch tensors.

    >>> client = WeightClient("localhost:50051")                        # doctest: +SKIP
    >>> client.publish(policy, model="policy")                          # doctest: +SKIP
    1
    >>> result = client.fetch("policy", newer_than=0)                   # doctest: +SKIP
    >>> policy.load_state_dict(result.state_dict())                     # doctest: +SKIP
    """

    def publish(
        self,
        weights: tensor_codec.Weights,
        model: str = "policy",
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Publish `weights` as a new version of `model`; return the version number.

        `weights` is an nn.Module (its state dict), a TensorDict (keys flattened with '.'), or a
        mapping of names to tensors. The call returns once the server committed the version.
        """
        encoded = tensor_codec.encode(weights)
        info = self.publish_bytes(model, encoded.parts, version=version, metadata=metadata, pin=pin, timeout=timeout)
        return info.version

    def publish_group(
        self,
        weights: Mapping[str, tensor_codec.Weights],
        *,
        version: int = 0,
        metadata: Mapping[str, str] | None = None,
        pin: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Publish several models (e.g. ``{"policy": actor, "critic": critic}``) under ONE
        version number, committed together; return that number."""
        encoded = {model: tensor_codec.encode(w).parts for model, w in weights.items()}
        infos = self.publish_group_bytes(encoded, version=version, metadata=metadata, pin=pin, timeout=timeout)
        return infos[0].version

    def fetch(
        self,
        model: str = "policy",
        *,
        version: int | None = None,
        newer_than: int | None = None,
        timeout: float | None = None,
    ) -> FetchResult | None:
        """Fetch the latest version, exactly `version`, or the latest only if newer than
        `newer_than` (None when it is not; no weights are transferred then)."""
        fetched = self.fetch_bytes(model, version=version, newer_than=newer_than, timeout=timeout)
        if fetched is None:
            return None
        header = parse_header(fetched.data)
        return FetchResult(fetched.info, tensor_codec.decode(header, fetched.data), fetched.data)

    def watch_weights(self, model: str = "policy", *, since: int = 0) -> Iterator[FetchResult]:
        """Yield the weights of every version committed after `since` as it lands.

        A version evicted between its event and its fetch is skipped (the next one follows).
        """
        for event in self.watch(model, since=since):
            try:
                result = self.fetch(model, version=event.version)
            except NotFoundError:
                continue
            if result is not None:
                yield result
