"""A tiny version of bench's language-model trace (bench/traces.py `lm_trace`: a transformers
Llama, AdamW on fp32 master weights at lr 1e-6, its bf16 cast published every step) through a real
server: each version fetched against the previous one is rebuilt bit for bit from far fewer bytes
than the whole model."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.traces import LM_CONFIGS, lm_trace
from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

MODEL = "trace-lm"


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_bf16_training_steps_travel_as_element_deltas_and_rebuild_bit_exact(client):
    trace = lm_trace(4, config="tiny")
    first = next(trace)
    assert {t.dtype for t in first.values()} == {torch.bfloat16}
    held = client.fetch(MODEL, version=client.publish(first, model=MODEL), transport="stream")
    full = held.stats.wire_bytes
    previous = first
    for weights in trace:
        version = client.publish(weights, model=MODEL)
        result = client.fetch(MODEL, version=version, base=held, transport="stream")
        assert result.base_version == version - 1 and not result.partial
        assert sorted(result.tensors) == sorted(weights)
        for name, tensor in weights.items():
            got = result.tensors[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert raw(got) == raw(tensor), name
        changed = {name for name, tensor in weights.items() if raw(tensor) != raw(previous[name])}
        assert changed and set(result.changed) == changed  # an optimizer step moved some bf16 elements
        # A few percent of the elements change per step: their places and values, not the model.
        assert result.stats.wire_bytes < full / 5, (result.stats.wire_bytes, full)
        held, previous = result, weights


def test_an_updater_keeps_a_transformers_policy_on_the_trace(client):
    """The policy is the model itself: its rotary `inv_freq` buffers, which no state dict carries,
    are not asked of the server; each step after the first comes as element deltas."""
    policy = LlamaForCausalLM(LlamaConfig(**LM_CONFIGS["tiny"])).to(torch.bfloat16)
    assert any("inv_freq" in name for name, _ in policy.named_buffers())
    updater = GrpcLocalWeightUpdater(client, model=MODEL, policy=policy, transport="bulk", incoming=False)
    full = None
    for weights in lm_trace(4, config="tiny"):
        client.publish(weights, model=MODEL)
        updater()
        full = full or updater.last_fetch.wire_bytes
        assert updater.last_fetch.wire_bytes <= full
        state = policy.state_dict()
        assert all(raw(state[name]) == raw(tensor) for name, tensor in weights.items())
    assert updater.version == 4 and updater.last_fetch.wire_bytes < full / 5
