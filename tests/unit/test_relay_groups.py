"""A relay commits each group version with its own members: two groups published under the same
number (`a`+`b` and `c`+`d`, each at v1) are two commits. Before, the relay kept its group commits
by number alone, so `c`'s follower joined `a`+`b`'s commit, returned once that was done, and `c`'s
v1 was never committed: a silent gap on the relay (and `d` waited 60 s, then committed alone)."""

from __future__ import annotations

import asyncio

import torch
from grpc_health.v1.health import aio as health_aio
from safetensors.torch import save

from weightserver.config import ServerConfig
from weightserver.metrics import NoMetrics
from weightserver.publish.incoming import IncomingPublishes
from weightserver.relay import relay as relay_module
from weightserver.relay.relay import Relay
from weightserver.storage.store import Upload, VersionStore


async def committed_groups(order: list[tuple[str, list[str]]]) -> list[list[str]]:
    """The commits a relay makes when its followers of `order`'s models reach group version 1 in that order."""
    store = VersionStore()
    relay = Relay(
        store,
        ServerConfig(upstream="127.0.0.1:1"),
        metrics=NoMetrics(),
        health=health_aio.HealthServicer(),
        incoming=IncomingPublishes(),
        on_removed=lambda model: None,
    )
    commits: list[list[str]] = []

    async def fetch_and_commit(models: list[str], number: int) -> None:  # no upstream: commit made-up bytes
        commits.append(models)
        store.publish_group([Upload(m, save({"w": torch.zeros(2)})) for m in models], version=number)

    relay._relay = fetch_and_commit
    relay._follow = lambda model: None  # the followers are this test's calls
    followers = []
    for model, members in order:
        followers.append(asyncio.create_task(relay._reach_group(model, members, 1)))
        await asyncio.sleep(0)  # each follower reaches the group in turn
    await asyncio.wait_for(asyncio.gather(*followers), 5)
    return commits


def test_two_groups_under_one_number_are_committed_each_with_its_members(monkeypatch):
    monkeypatch.setattr(relay_module, "GROUP_WAIT_SECONDS", 3.0)
    ab, cd = ["a", "b"], ["c", "d"]
    commits = asyncio.run(committed_groups([("a", ab), ("c", cd), ("b", ab), ("d", cd)]))
    assert sorted(commits) == [ab, cd]
