"""Small policies for the torchrl tests, in a module of their own so that spawned collector
workers can import them."""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModule


class PendulumActor(torch.nn.Module):
    """Maps PendulumEnv's scalar observations ("th", "thdot") to a 1-d action in [-2, 2]."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.tanh(self.mlp(torch.stack([th, thdot], -1)))


class TwoHeadActor(torch.nn.Module):
    """A body and two heads of the same shape, both used: swapping the heads changes actions."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 16)
        self.head_a = torch.nn.Linear(16, 1)
        self.head_b = torch.nn.Linear(16, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.body(torch.stack([th, thdot], -1)))
        return 2.0 * torch.tanh(self.head_a(hidden) - 0.5 * self.head_b(hidden))


class PendulumQValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([th.unsqueeze(-1), thdot.unsqueeze(-1), action], -1))


def make_policy(seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(PendulumActor(), in_keys=["th", "thdot"], out_keys=["action"])


def make_two_head_policy(seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(TwoHeadActor(), in_keys=["th", "thdot"], out_keys=["action"])


def make_env():
    from torchrl.envs import PendulumEnv

    return PendulumEnv()


def actions_of(policy: TensorDictModule, batch) -> torch.Tensor:
    """What `policy` does on the observations of `batch`."""
    with torch.no_grad():
        return policy.module(batch["th"], batch["thdot"])
