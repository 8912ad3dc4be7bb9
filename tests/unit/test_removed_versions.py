"""The numbers of removed (evicted, deleted) and missed versions: held as runs, they answer as a plain
set would, and their size grows with the runs (holes left by pins and deletes), not with the versions."""

from __future__ import annotations

import random

import pytest

from weightserver.protocol.errors import VersionEvicted, VersionNotFound
from weightserver.protocol.safetensors_format import build_header, parse_header
from weightserver.storage.index import ModelState, NumberRuns, Version
from weightserver.storage.store import VersionStore


def payload(n: int) -> bytes:
    prefix, _ = build_header([("w", "U32", (1,), 4)])
    return prefix + n.to_bytes(4, "little")


def runs_of(numbers: set[int]) -> list[tuple[int, int]]:
    """The maximal runs [start, stop) of `numbers`, in order."""
    runs: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0], n + 1)
        else:
            runs.append((n, n + 1))
    return runs


def check(runs: NumberRuns, numbers: set[int], top: int) -> None:
    """`runs` answers as the plain set `numbers` does, for every number and pair up to `top` + 2."""
    assert runs.runs == runs_of(numbers)
    for n in range(-1, top + 3):
        assert (n in runs) == (n in numbers), n
    up_to = {n: sum(1 for m in numbers if m <= n) for n in range(-2, top + 3)}  # how many are <= n
    for after in range(-1, top + 2):
        for before in range(after, top + 3):
            assert runs.any_between(after, before) == (up_to[before - 1] > up_to[after]), (after, before)


@pytest.mark.parametrize("seed", range(8))
def test_removed_versions_answer_as_a_plain_set(seed: int) -> None:
    """Random publishes, pins, unpins and deletes on a store (keep=3): the versions it removes, fed to
    NumberRuns, answer membership and "any between" as a plain set does, and the store's own answers
    (VersionEvicted vs VersionNotFound, gap_between) agree with that set."""
    rng = random.Random(seed)
    store = VersionStore(keep=3)
    removed = NumberRuns()
    gone: set[int] = set()  # evicted or deleted
    deleted: set[int] = set()
    retained: list[int] = []
    for step in range(200):
        op = rng.random()
        if op < 0.6 or not retained:
            store.publish("policy", payload(step), pin=rng.random() < 0.1)
        elif op < 0.8:
            store.set_pinned("policy", rng.choice(retained), rng.random() < 0.5)
        elif len(retained) > 1:
            number = rng.choice(retained)
            store.delete("policy", number)
            deleted.add(number)
        now = [r.version for r in store.versions("policy")]
        for number in set(retained) - set(now):
            gone.add(number)
            removed.add(number)
        retained = now
        check(removed, gone, retained[-1])
    top = retained[-1]
    for number in range(0, top + 2):
        if number in retained:
            assert store.get("policy", number).version == number
        else:
            expected = VersionEvicted if number in gone - deleted else VersionNotFound
            with pytest.raises(expected):
                store.get("policy", number)
    for after in range(0, top + 1):
        for before in range(after + 1, top + 2):
            assert store.gap_between("policy", after, before) == any(after < n < before for n in gone)


def test_numbers_added_in_any_order_merge_into_runs() -> None:
    """A relay's missed numbers come in any order, and again: they merge into the same runs."""
    rng = random.Random(7)
    for _ in range(50):
        numbers = rng.sample(range(1, 60), rng.randrange(0, 40))
        runs, held = NumberRuns(), set()
        for n in numbers + numbers[: len(numbers) // 2]:
            runs.add(n)
            held.add(n)
            assert runs.runs == runs_of(held)
        check(runs, held, 60)


def test_evicting_many_versions_holds_a_few_runs() -> None:
    """100,000 versions through retention (keep=2) with two pinned: the removed numbers are three runs,
    not 99,998 numbers, and still answer right."""
    data = payload(0)
    header = parse_header(data)
    state = ModelState()
    for number in range(1, 100_001):
        pinned = number in (10, 50_000)
        state.versions[number] = Version(model="policy", version=number, data=data, header=header, pinned=pinned)
        state.high_water = number
        state.evict(keep=2)
    assert list(state.versions) == [10, 50_000, 99_999, 100_000]
    assert state.removed.runs == [(1, 10), (11, 50_000), (50_001, 99_999)]
    assert 1 in state.removed and 99_998 in state.removed
    assert 10 not in state.removed and 50_000 not in state.removed and 99_999 not in state.removed
    assert state.gap(9, 11) is False and state.gap(10, 12) is True
    assert state.gap(99_998, 99_999) is False and state.gap(49_999, 50_001) is False
    assert state.missed.runs == []
