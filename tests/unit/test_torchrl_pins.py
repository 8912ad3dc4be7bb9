"""Pins of the torchrl private names weightclient.torchrl relies on, checked against the
installed torchrl: an upgrade that renames or moves one fails here, not in a collector."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torchrl")

from torchrl.trainers import Trainer, UpdateWeights
from torchrl.weight_update import SharedMemWeightSyncScheme


def test_send_ack_is_the_workers_hook_after_it_applied_and_bumped_its_version():
    # GrpcWeightSyncScheme._send_ack stamps the server version in a worker: it must be called
    # right after the worker's collector applied the weights (and bumped its PolicyVersion).
    params = list(inspect.signature(SharedMemWeightSyncScheme._send_ack).parameters.values())
    assert [(p.name, p.default) for p in params] == [("self", inspect.Parameter.empty), ("message", "updated")]
    loop = inspect.getsource(SharedMemWeightSyncScheme._background_receive_loop)
    assert loop.index("update_policy_weights_(") < loop.index("self._send_ack(")


def test_trainer_counts_optimizer_steps_in_optim_count():
    # PublishWeights(interval_unit="optim_steps") reads Trainer._optim_count where the stepper
    # keeps no count, as torchrl's own UpdateWeights does.
    assert "cls._optim_count: int = 0" in inspect.getsource(Trainer.__new__)
    assert "self._optim_count += 1" in inspect.getsource(Trainer)
    assert "trainer._optim_count" in inspect.getsource(UpdateWeights)
