"""Server weight names -> the local policy's (`KeyMap`), and `check_weights`, which refuses a
mismatch before anything is written, so that a policy is never left half-updated."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict, TensorDictBase


@dataclass(frozen=True)
class KeyMap:
    """Server key -> local key: `rename` (local -> server key) first; then `select` keeps keys under a
    prefix, `strip_prefix` removes one (DDP's), `add_prefix` adds one, `fn` maps the rest (None: drop).

    >>> KeyMap(strip_prefix="module.").map_key("module.0.weight")
    '0.weight'
    >>> KeyMap(select="loss_module.actor_network.", add_prefix="module.").map_key("loss_module.actor_network.0.bias")
    'module.0.bias'
    """

    rename: Mapping[str, str] = field(default_factory=dict)
    select: str | None = None
    strip_prefix: str | None = None
    add_prefix: str | None = None
    fn: Callable[[str], str | None] | None = None

    def map_key(self, key: str) -> str | None:
        if self.select is not None and not key.startswith(self.select):
            return None
        key = (self.add_prefix or "") + key.removeprefix(self.select or "").removeprefix(self.strip_prefix or "")
        return self.fn(key) if self.fn is not None else key

    def apply(self, server: Mapping[str, torch.Tensor], *, partial: bool = False) -> dict[str, torch.Tensor]:
        """Rename the keys of flat `server` weights; raises KeyError on a collision, or where a `rename`
        names a server key they lack (`partial`: a delta, which carries only the tensors that changed)."""
        for local_key, server_key in self.rename.items():
            if server_key not in server and not partial:
                raise KeyError(f"KeyMap.rename maps {local_key!r} from {server_key!r}, which the server weights lack")
        origin = dict(self.rename)  # local key -> server key
        renamed = set(self.rename.values())
        for server_key in server:
            if server_key in renamed or (local_key := self.map_key(server_key)) is None:
                continue
            if local_key in origin:
                raise KeyError(f"server keys {origin[local_key]!r} and {server_key!r} both map to {local_key!r}")
            origin[local_key] = server_key
        return {local_key: server[server_key] for local_key, server_key in origin.items() if server_key in server}


IDENTITY = KeyMap()


def flat_weights(weights: TensorDictBase | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{dotted key: tensor} from a (nested) TensorDict or mapping."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if isinstance(value, (TensorDictBase, Mapping)):
            flat.update({f"{key}.{inner}": tensor for inner, tensor in flat_weights(value).items()})
        else:
            flat[key] = value
    return flat


def map_keys(
    server: TensorDictBase | Mapping[str, torch.Tensor],
    key_map: KeyMap | Callable[[str], str | None] = IDENTITY,
    *,
    partial: bool = False,
) -> TensorDict:
    """`server` weights renamed by `key_map` (flat, dotted keys); unchecked (see `check_weights`).
    `partial`: a delta's weights (see `KeyMap.apply`)."""
    key_map = key_map if isinstance(key_map, KeyMap) else KeyMap(fn=key_map)
    return TensorDict(key_map.apply(flat_weights(server), partial=partial), batch_size=[])


def check_weights(
    weights: TensorDictBase | Mapping[str, torch.Tensor],
    local: TensorDictBase | Mapping[str, torch.Tensor],
    *,
    source: str = "server weights",
    partial: bool = False,
    allow_cast: bool = False,
) -> TensorDict:
    """`weights` flat, if they match `local`; else a KeyError naming every mismatch and both key
    sets. `partial`: a delta may leave local keys out; `allow_cast`: float dtypes may differ."""
    mapped, local_flat = flat_weights(weights), flat_weights(local)
    missing = [] if partial else sorted(set(local_flat) - set(mapped))
    unexpected = sorted(set(mapped) - set(local_flat))
    shapes, dtypes = [], []
    for key in sorted(set(mapped) & set(local_flat)):
        theirs, ours = mapped[key], local_flat[key]
        if not isinstance(theirs, torch.Tensor):
            dtypes.append(f"{key}: {source} hold a {type(theirs).__name__}, not a tensor")
            continue
        if theirs.shape != ours.shape:
            shapes.append(f"{key}: {source} {tuple(theirs.shape)} vs local {tuple(ours.shape)}")
        if theirs.dtype != ours.dtype and not (allow_cast and theirs.is_floating_point() and ours.is_floating_point()):
            dtypes.append(f"{key}: {source} {theirs.dtype} vs local {ours.dtype}")
    found = [
        (f"missing (local keys the {source} lack)", missing),
        (f"unexpected ({source} keys with no local parameter)", unexpected),
        ("shape mismatches", shapes),
        ("dtype mismatches", dtypes),
    ]
    if problems := [f"{what}: {keys}" for what, keys in found if keys]:
        raise KeyError(
            f"{source} do not match the local policy; nothing was updated. "
            + "; ".join(problems)
            + f". Local keys: {sorted(local_flat)}. Mapped {source} keys: {sorted(mapped)}. "
            "Pass a KeyMap (select=, strip_prefix=, add_prefix=, rename=, fn=) to line them up."
        )
    return TensorDict(mapped, batch_size=[])
