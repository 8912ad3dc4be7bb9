"""Tensors <-> safetensors bytes with no whole-model copy: views of the storage, views of a buffer."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from tensordict import TensorDictBase

from weightclient.transports.base import receive_buffer
from weightserver.protocol.errors import InvalidRequest
from weightserver.protocol.safetensors_format import DTYPE_SIZES, SafetensorsHeader, build_header

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_SAFETENSORS.items()}

Weights = torch.nn.Module | TensorDictBase | Mapping[str, torch.Tensor]


def encode(weights: Weights, metadata: Mapping[str, str] | None = None) -> list[memoryview]:
    """A safetensors file in parts (header, each tensor's bytes), valid while the tensors are."""
    prefix, prepared = _framed(weights, metadata)
    return [memoryview(prefix), *(tensor_bytes(tensor) for _, tensor in prepared if tensor.numel())]


def snapshot(weights: Weights, metadata: Mapping[str, str] | None = None, into: memoryview | None = None) -> memoryview:
    """The file copied into one buffer (`into` if large enough) by torch's `copy_` (every core)."""
    prefix, prepared = _framed(weights, metadata, to_cpu=False)
    buffer = receive_buffer(len(prefix) + sum(t.nbytes for _, t in prepared), into)
    buffer[: len(prefix)] = prefix
    target = torch.frombuffer(buffer, dtype=torch.uint8)
    position = len(prefix)
    for _, tensor in prepared:
        if tensor.nbytes:
            # As its own dtype: ~10% faster than bytes (the layout aligns each to its element size).
            target[position : position + tensor.nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
            position += tensor.nbytes
    return buffer


def _framed(
    weights: Weights, metadata: Mapping[str, str] | None, *, to_cpu: bool = True
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    if isinstance(weights, torch.nn.Module):
        items = weights.state_dict(keep_vars=True).items()  # each one is detached below
    elif isinstance(weights, TensorDictBase):
        items = weights.flatten_keys(".").items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        raise TypeError(
            f"cannot publish a {type(weights).__name__}: pass an nn.Module, a TensorDict or a "
            "state dict (a mapping of names to tensors)"
        )
    prepared: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        if not isinstance(name, str):
            raise InvalidRequest(f"key {name!r} is invalid: tensor names must be strings")
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"key {name!r} is invalid: expected torch.Tensor but received {type(tensor).__name__}")
        if tensor.dtype not in TORCH_TO_SAFETENSORS:
            raise InvalidRequest(
                f"key {name!r}: dtype {tensor.dtype} has no safetensors equivalent; "
                f"supported: {', '.join(str(d) for d in TORCH_TO_SAFETENSORS)}"
            )
        if tensor.layout != torch.strided or tensor.is_nested:  # (torch's own errors here name no key)
            kind = "a nested" if tensor.is_nested else f"a {tensor.layout}"
            raise InvalidRequest(f"key {name!r}: {kind} tensor has no safetensors form; publish it dense (strided)")
        tensor = tensor.detach().cpu() if to_cpu else tensor.detach()  # (cpu() of a CPU tensor is itself)
        prepared.append((name, tensor.contiguous()))
    # Largest element size first (as safetensors does): each tensor starts aligned to its own.
    prepared.sort(key=lambda item: (-item[1].element_size(), item[0]))
    layout = tuple((name, TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape), t.nbytes) for name, t in prepared)
    try:
        prefix = _header(layout, tuple(metadata.items()) if metadata else ())
    except TypeError:  # unhashable metadata values: frame without the cache
        prefix = build_header(layout, metadata)[0]
    return prefix, prepared


@functools.lru_cache(maxsize=16)
def _header(layout: tuple[tuple[str, str, tuple[int, ...], int], ...], metadata: tuple[tuple[str, str], ...]) -> bytes:
    """Cached: a trainer publishes one layout again and again (JSON: a tenth of 16 MiB's memcpy)."""
    return build_header(layout, dict(metadata))[0]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(bytearray())


def decode(header: SafetensorsHeader, buffer: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors viewing `buffer` (no copy where aligned), as `header` lists them."""
    result: dict[str, torch.Tensor] = {}
    for entry in header.tensors:
        dtype = SAFETENSORS_TO_TORCH.get(entry.dtype)
        if dtype is None:
            raise InvalidRequest(f"tensor {entry.name!r}: dtype {entry.dtype} is not supported by this torch build")
        if entry.nbytes == 0:
            result[entry.name] = torch.empty(entry.shape, dtype=dtype)
            continue
        offset = header.data_start + entry.begin
        count = entry.nbytes // DTYPE_SIZES[entry.dtype]
        tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(entry.shape)
        if offset % DTYPE_SIZES[entry.dtype]:
            tensor = tensor.clone()  # misaligned in a file framed by another writer
        result[entry.name] = tensor
    return result
