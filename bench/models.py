"""The policies the benchmarks move around: a few float32 tensors totalling N bytes.

Imported only where torch is already needed (the bench process, torch-using children).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class FlatPolicy(torch.nn.Module):
    """`n_tensors` float32 parameters `w0`, `w1`, ... whose sizes add up to `nbytes`.

    The values are `fill + i` for parameter i, written at construction, so every page is
    resident before anything is timed or measured.
    """

    def __init__(self, nbytes: int, n_tensors: int = 4, fill: float = 0.0) -> None:
        super().__init__()
        numel = nbytes // 4
        if numel < n_tensors:
            raise ValueError(f"{nbytes} bytes cannot hold {n_tensors} float32 tensors")
        base, extra = divmod(numel, n_tensors)
        for i in range(n_tensors):
            count = base + (1 if i < extra else 0)
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.full((count,), fill + i), requires_grad=False))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def shapes(self) -> list[int]:
        return [p.numel() for p in self.parameters()]


def policy_from_shapes(shapes: list[int], fill: float = 0.0) -> FlatPolicy:
    """A FlatPolicy with exactly these parameter lengths (as `FlatPolicy.shapes()` returns)."""
    policy = FlatPolicy(4 * len(shapes), len(shapes), fill)
    for i, count in enumerate(shapes):
        setattr(policy, f"w{i}", torch.nn.Parameter(torch.full((count,), fill + i), requires_grad=False))
    return policy


@torch.no_grad()
def copy_into(policy: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy fetched tensors into the live policy's parameters in place (`p.copy_`)."""
    for name, param in policy.named_parameters():
        param.copy_(tensors[name])


@torch.no_grad()
def same_weights(policy: torch.nn.Module, other: torch.nn.Module) -> bool:
    """Whether two policies hold equal parameters (checked after the timed loops)."""
    theirs = dict(other.named_parameters())
    return all(torch.equal(p, theirs[name]) for name, p in policy.named_parameters())
