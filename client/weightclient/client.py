"""WeightClient: publish and fetch torch weights (nn.Module, TensorDict, state dict)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from weightclient import tensors as tensor_codec
from weightclient.core.background import BackgroundPublisher, PublishFuture
from weightclient.core.publish import publish_version
from weightclient.core.retry import Deadline
from weightclient.core.service_client import FetchedBytes, WeightServiceClient
from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import IntegrityError, InvalidRequest, NotFoundError
from weightserver.protocol.limits import version_number
from weightserver.protocol.safetensors_format import parse_header
from weightserver.protocol.selection import Selection
from weightserver.protocol.version_info import TensorInfo, VersionInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchResult(FetchedBytes):
    """A fetched version; the tensors view `data` (with `placed`, they are the caller's own, filled in place).
    `partial`: a delta's changed tensors only. With a selection, `info` describes the selection's file (its
    tensors are the slices) under the version's number."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    partial: bool = False

    @property
    def version(self) -> int:
        return self.info.version

    @property
    def metadata(self) -> dict[str, str]:
        return self.info.metadata

    @property
    def weights(self) -> TensorDict:
        """Keyed like the state dict ("0.weight"); `.unflatten_keys(".")` nests it."""
        return TensorDict(dict(self.tensors), batch_size=[])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def _placeable(tensor: torch.Tensor, entry: TensorInfo) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor_codec.TORCH_TO_SAFETENSORS.get(tensor.dtype) == entry.dtype
        and tuple(tensor.shape) == tuple(entry.shape)
    )


def _check_delta(info: VersionInfo, tensors: dict[str, torch.Tensor], dtype: str) -> None:
    expected = {t.name: t for t in info.tensors}
    if unknown := sorted(set(tensors) - set(expected)):
        raise IntegrityError(f"{info.model!r} v{info.version}: the delta carries unknown tensors {unknown}")
    if dtype:
        return
    for name, tensor in tensors.items():
        if expected[name].xxh3 and xxh3_hex(tensor_codec.tensor_bytes(tensor)) != expected[name].xxh3:
            raise IntegrityError(f"{info.model!r} v{info.version}: tensor {name!r} does not match its digest")


def _unchanged_from_base(
    base: FetchResult, info: VersionInfo, changed: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """The base's tensors the delta did not carry; None if one is missing or changed since."""
    kept = [(entry, base.tensors.get(entry.name)) for entry in info.tensors if entry.name not in changed]
    if any(tensor is None or xxh3_hex(tensor_codec.tensor_bytes(tensor)) != entry.xxh3 for entry, tensor in kept):
        return None
    return {entry.name: tensor for entry, tensor in kept}


class WeightClient(WeightServiceClient):
    """Publish and fetch model weights as torch tensors.

    >>> client = WeightClient("localhost:50051")                        # doctest: +SKIP
    >>> client.publish(policy, model="policy")                          # doctest: +SKIP
    1
    >>> result = client.fetch("policy", newer_than=0)                   # doctest: +SKIP
    >>> policy.load_state_dict(result.state_dict())                     # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # One per set of models published with wait=False: a newer snapshot replaces only a waiting one
        # of the same models (one of others would never be published).
        self._publishers: dict[frozenset[str], BackgroundPublisher] = {}
        super().__init__(*args, **kwargs)

    def publish(self, weights: tensor_codec.Weights, model: str = "policy", **options) -> int | PublishFuture:
        """Publish an nn.Module, TensorDict or state dict: its version, or with wait=False a future."""
        return self.publish_group({model: weights}, **options)

    def publish_group(
        self, weights: Mapping[str, tensor_codec.Weights], *, wait: bool = True, **options
    ) -> int | PublishFuture:
        """Publish several models (``{"policy": actor, "critic": critic}``) under ONE version."""
        if not wait:
            publish_version(options.get("version", 0))  # here, not in the future it returns
            publisher = self._publishers.setdefault(
                frozenset(weights),
                BackgroundPublisher(lambda data, **o: self.publish_group_bytes(data, **o)[0].version),
            )
            snapshot = {model: tensor_codec.snapshot(w, into=publisher.spare_buffer()) for model, w in weights.items()}
            return publisher.submit(snapshot, **options)
        encoded = {model: tensor_codec.encode(w) for model, w in weights.items()}
        return self.publish_group_bytes(encoded, **options)[0].version

    def flush(self, timeout: float | None = None) -> bool:
        deadline = Deadline.after(timeout)
        publishers = list(self._publishers.values())
        return all(p.flush(deadline.remaining()) for p in publishers) and super().flush(deadline.remaining())

    def close(self) -> None:
        for publisher in list(self._publishers.values()):
            publisher.close()
        super().close()

    def fetch(
        self,
        model: str = "policy",
        *,
        base: FetchResult | VersionInfo | int | None = None,
        dtype: str | None = None,
        place: Callable[[VersionInfo], Mapping[str, torch.Tensor] | None] | None = None,
        timeout: float | None = None,
        deadline: Deadline | None = None,
        consume_base: bool = False,
        select: Selection | str | Iterable[str] | None = None,
        **options,
    ) -> FetchResult | None:
        """`fetch_bytes` decoded into tensors. `base`: a version held, so only changed tensors come (a
        FetchResult gives a complete result, rebuilt from the changed elements where that is smaller, except on the
        server's host, where "auto" maps the version whole; a number a partial one). `consume_base`: the result may
        be rebuilt in the base's own bytes (writable), which it then holds. `place` may return {name: contiguous CPU
        tensor} to receive into; they may hold unverified bytes if it fails. `select`: only some tensors, or slices
        of them (`weightclient.tensor_parallel(rank, world, plan)`: a tensor-parallel rank's shard); glob patterns
        select whole tensors; a `base` must then be the same selection."""
        if isinstance(base, FetchResult) and (base.partial or base.dtype or dtype):
            raise InvalidRequest(
                "a delta against a FetchResult needs a complete result fetched without dtype, and no dtype now; "
                "pass base=<version number> for a partial result instead"
            )
        deadline = deadline or self._deadline(timeout)  # a refetch gets what is left of it
        base_info = base.info if isinstance(base, FetchResult) else base if isinstance(base, VersionInfo) else None
        meaning = "0 or None: none; or a FetchResult or VersionInfo"
        base_version = base_info.version if base_info else version_number(base or 0, "base", meaning=meaning)
        targets: dict[str, torch.Tensor] = {}

        def views_for(info: VersionInfo) -> dict[str, memoryview] | None:
            wanted = place(info) or {}  # (checked_views declines an empty placement)
            layout = {t.name: t for t in info.tensors}
            if not all(name in layout and _placeable(tensor, layout[name]) for name, tensor in wanted.items()):
                return None
            targets.update(wanted)
            return {name: tensor_codec.tensor_bytes(tensor.detach()) for name, tensor in wanted.items()}

        held = base if isinstance(base, FetchResult) and not base.placed else None
        if held is not None and options.get("transport", "auto") == "auto" and self.transports.usable("shm"):
            # On the server's host the version's file is mapped, not copied: rebuilding it from a delta
            # would copy the base (or fault in a copy of every page it writes), 70x slower at 256 MiB.
            held, base_info, base_version = None, None, 0
        fetched = self.fetch_bytes(
            model,
            base_version=base_version,
            dtype=dtype or "",
            deadline=deadline,
            base_xxh3=base_info.xxh3 if base_info is not None else "",
            place=views_for if place is not None else None,
            base_bytes=held.data if held is not None else None,
            consume_base=consume_base,
            select=select,
            **options,
        )
        if fetched is None:
            return None

        def refetch(why: str) -> FetchResult | None:
            log.info("the base of %s v%d%s; fetching whole", model, fetched.info.version, why)
            kept = {k: options[k] for k in ("transport", "stall", "retry") if k in options}  # (not `into`: the base)
            return self.fetch(model, version=fetched.info.version, deadline=deadline, select=select, **kept)

        if fetched.placed:
            return FetchResult(**vars(fetched), tensors=targets)
        rebuilt = fetched.changed is not None  # on the held base, as the delta arrived
        if rebuilt and xxh3_hex(fetched.data) != fetched.info.xxh3:
            return refetch(": its bytes changed since it was fetched")
        if held is not None and fetched.base_version and not rebuilt:
            return refetch(": its layout differs")
        tensors = tensor_codec.decode(parse_header(fetched.data), fetched.data)
        partial = bool(fetched.base_version) and not rebuilt
        if partial:
            _check_delta(fetched.info, tensors, fetched.dtype)
            if isinstance(base, FetchResult):
                unchanged = _unchanged_from_base(base, fetched.info, tensors)
                if unchanged is None:
                    return refetch(" changed since it was fetched")
                tensors, partial = {**unchanged, **tensors}, False
        return FetchResult(**vars(fetched), tensors=tensors, partial=partial)

    def watch_weights(self, model: str = "policy", *, since: int = 0) -> Iterator[FetchResult]:
        """Each version committed after `since`, fetched; each fetch runs as long as its bytes keep coming."""
        events = self.watch(model, since=since)  # (a bad `since` is refused here, at the call)

        def fetched() -> Iterator[FetchResult]:
            for event in events:
                try:
                    result = self.fetch(model, version=event.version, stall=self.timeout or 0.0)
                except NotFoundError:
                    continue
                if result is not None:
                    yield result

        return fetched()
