"""The Pendulum environment, the DDPG actor and critic, and the collectors' exploring policy.

`PendulumEnv` (pure torch) observes the angle `th` in [-pi, pi] and the angular velocity
`thdot`; both networks see (cos th, sin th, thdot), which has no jump at +-pi. Episodes are
cut at 200 steps, as in gym's Pendulum-v1, and `episode_reward` sums each one's rewards.
"""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from torchrl.envs import Compose, EnvBase, PendulumEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import ValueOperator

from weightclient.torchrl.key_mapping import KeyMap

MAX_TORQUE = 2.0
EPISODE_STEPS = 200
OBSERVATION_KEYS = ["th", "thdot"]
# The keys a transition needs for DDPG and for the demo's statistics (what goes into the spool).
SPOOL_KEYS = [
    "th",
    "thdot",
    "action",
    ("next", "th"),
    ("next", "thdot"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
    ("next", "episode_reward"),
    ("next", "policy_version"),
]
# The collector's policy is TensorDictSequential(actor, noise): the published actor's keys
# ("module.mlp.0.weight") sit under "module.0." there.
COLLECTOR_KEY_MAP = KeyMap(add_prefix="module.0.")


def features(th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
    return torch.stack([th.cos(), th.sin(), thdot], -1)


def mlp(inputs: int, hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


class Actor(torch.nn.Module):
    """(th, thdot) -> torque in [-2, 2]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp(3, hidden)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return MAX_TORQUE * torch.tanh(self.mlp(features(th, thdot)))


class Critic(torch.nn.Module):
    """(th, thdot, action) -> Q value."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp(4, hidden)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([features(th, thdot), action], -1))


class GaussianNoise(torch.nn.Module):
    """Adds N(0, sigma) to the action and clips it to the torque range. No parameters or
    buffers, so the policy's weights are exactly the actor's."""

    def __init__(self, sigma: float) -> None:
        super().__init__()
        self.sigma = sigma

    def forward(self, action: torch.Tensor) -> torch.Tensor:
        return (action + self.sigma * torch.randn_like(action)).clamp(-MAX_TORQUE, MAX_TORQUE)


def make_actor(hidden: int) -> TensorDictModule:
    return TensorDictModule(Actor(hidden), in_keys=OBSERVATION_KEYS, out_keys=["action"])


def make_critic(hidden: int) -> ValueOperator:
    return ValueOperator(Critic(hidden), in_keys=[*OBSERVATION_KEYS, "action"])


def make_exploring_policy(hidden: int, sigma: float) -> TensorDictSequential:
    """What a collector runs: the actor (weights from the server) followed by Gaussian noise."""
    noise = TensorDictModule(GaussianNoise(sigma), in_keys=["action"], out_keys=["action"])
    return TensorDictSequential(make_actor(hidden), noise)


def make_env(seed: int) -> EnvBase:
    """PendulumEnv with 200-step episodes and a running `episode_reward`."""
    env = TransformedEnv(PendulumEnv(seed=seed), Compose(StepCounter(max_steps=EPISODE_STEPS), RewardSum()))
    env.set_seed(seed)
    return env
