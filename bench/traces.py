"""Real training traces: the successive state dicts a trainer publishes, for the delta rows.

Two generators, each yielding `versions` state dicts ({name: contiguous CPU tensor}, fresh
tensors each time, so a caller may keep any of them): the first is the weights before training,
each next one what the trainer publishes after its next publish interval.

- `ddpg_trace`: the demo's DDPG actor (`demo.models.Actor`, fp32, 64 hidden units), trained as
  the demo's trainer does (one Adam over actor and critic, lr 1e-3, soft-updated target critic)
  on synthetic Pendulum transitions (random states and torques, the next state from Pendulum's
  dynamics, its reward), published every `publish_every` (50) optimizer steps.
- `lm_trace`: a causal language model built from a `transformers` LlamaConfig (random init, no
  download; `"llama-134m"`: 134.1M parameters), trained with AdamW on fp32 master weights at lr 1e-6
  on random tokens, its bf16 cast (`{k: v.to(torch.bfloat16)}`) published after every optimizer step.

Both are deterministic for a seed (on one machine and torch build).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# LlamaConfig settings of the language models (random init; any LlamaConfig field may be given).
LM_CONFIGS: dict[str, dict[str, Any]] = {
    # 134.1M parameters: 12 layers of 768, embeddings and head untied (32000 x 768 each); 268 MB in bf16.
    "llama-134m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    # 0.2M parameters, for tests.
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
}

# Pendulum-v1's constants (torchrl's PendulumEnv has the same): the demo's environment.
_G, _DT, _MAX_SPEED, _MAX_TORQUE = 10.0, 0.05, 8.0, 2.0


def _snapshot(module: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fresh contiguous copies of `module`'s state (cast to `dtype` where given)."""
    with torch.no_grad():
        return {
            name: (value.to(dtype) if dtype is not None else value).detach().clone().contiguous()
            for name, value in module.state_dict().items()
        }


def lm_trace(
    versions: int = 6,
    *,
    config: str | Mapping[str, Any] = "llama-134m",
    lr: float = 1e-6,
    batch_size: int = 1,
    seq_len: int = 32,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """The bf16 casts a trainer of a causal LM publishes: the initial weights, then one per AdamW
    step (`versions` in all). `config`: a name in LM_CONFIGS or LlamaConfig keyword arguments.
    Each step is a next-token loss on `batch_size` x `seq_len` uniformly random tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(LM_CONFIGS[config] if isinstance(config, str) else config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    tokens = torch.Generator().manual_seed(seed + 1)
    yield _snapshot(model, torch.bfloat16)
    for _ in range(versions - 1):
        ids = torch.randint(0, settings["vocab_size"], (batch_size, seq_len), generator=tokens)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        yield _snapshot(model, torch.bfloat16)


def _pendulum_batch(size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random Pendulum transitions: states, torques, rewards and next states as the env computes them."""
    th = (torch.rand(size, 1, generator=generator) * 2 - 1) * math.pi
    thdot = (torch.rand(size, 1, generator=generator) * 2 - 1) * _MAX_SPEED
    action = (torch.rand(size, 1, generator=generator) * 2 - 1) * _MAX_TORQUE
    reward = -(th**2 + 0.1 * thdot**2 + 0.001 * action**2)
    next_thdot = (thdot + (3 * _G / 2 * th.sin() + 3.0 * action) * _DT).clamp(-_MAX_SPEED, _MAX_SPEED)
    next_th = torch.remainder(th + next_thdot * _DT + math.pi, 2 * math.pi) - math.pi
    return {"th": th, "thdot": thdot, "action": action, "reward": reward, "next_th": next_th, "next_thdot": next_thdot}


def ddpg_trace(
    versions: int = 6,
    *,
    publish_every: int = 50,
    hidden: int = 64,
    batch_size: int = 256,
    lr: float = 1e-3,
    gamma: float = 0.99,
    tau: float = 0.005,
    seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """The fp32 actor a DDPG trainer publishes: the initial weights, then one every `publish_every`
    optimizer steps (`versions` in all). The demo's defaults: hidden 64, batch 256, Adam lr 1e-3,
    gamma 0.99, tau 0.005, and torchrl's DDPGLoss's targets (a soft-updated target critic, the actor
    itself for the next action). Each step samples fresh synthetic transitions (`_pendulum_batch`)."""
    from demo.models import Actor, Critic

    torch.manual_seed(seed)
    actor, critic, target_critic = Actor(hidden), Critic(hidden), Critic(hidden)
    target_critic.load_state_dict(critic.state_dict())
    # As the demo: one Adam over both networks; the actor loss sees the critic's parameters detached.
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    yield _snapshot(actor)
    for _ in range(versions - 1):
        for _ in range(publish_every):
            b = _pendulum_batch(batch_size, data)
            with torch.no_grad():
                next_action = actor(b["next_th"].squeeze(-1), b["next_thdot"].squeeze(-1))
                target = b["reward"] + gamma * target_critic(
                    b["next_th"].squeeze(-1), b["next_thdot"].squeeze(-1), next_action
                )
            th, thdot = b["th"].squeeze(-1), b["thdot"].squeeze(-1)
            value_loss = torch.nn.functional.mse_loss(critic(th, thdot, b["action"]), target)
            critic.requires_grad_(False)
            actor_loss = -critic(th, thdot, actor(th, thdot)).mean()
            critic.requires_grad_(True)
            optimizer.zero_grad(set_to_none=True)
            (actor_loss + value_loss).backward()
            optimizer.step()
            with torch.no_grad():  # the demo's SoftUpdate(tau): DDPGLoss delays the critic, not the actor
                for p, t in zip(critic.parameters(), target_critic.parameters(), strict=True):
                    t.lerp_(p, tau)
        yield _snapshot(actor)
