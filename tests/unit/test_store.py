"""Tests of VersionStore alone (no gRPC): publishing, integrity, names, retention, delete,
cursors, listeners and commit hooks, persistence with crash debris, and thread safety."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import pytest
from waiting import wait_until

from weightserver.protocol.errors import (
    CursorOutOfRange,
    IntegrityError,
    InvalidModelName,
    InvalidRequest,
    InvalidSafetensors,
    ModelNotFound,
    ModelTooLarge,
    VersionConflict,
    VersionEvicted,
    VersionNotFound,
    clipped_repr,
)
from weightserver.protocol.names import validate_model_name
from weightserver.protocol.safetensors_format import build_header, parse_header
from weightserver.storage.store import Commit, Upload, Version, VersionStore

STORE_LOGGER = "weightserver.storage"  # the store and its parts log under it

# ---------------------------------------------------------------------------- helpers


def make_file(tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A valid safetensors file from name -> (dtype, shape, raw bytes)."""
    prefix, _ = build_header(
        [(name, dtype, shape, len(raw)) for name, (dtype, shape, raw) in tensors.items()], metadata
    )
    return prefix + b"".join(raw for _, _, raw in tensors.values())


def payload(n: int) -> bytes:
    """A small valid file whose bytes are distinct for every n."""
    return make_file({"w": ("U32", (2,), n.to_bytes(4, "little") * 2), "b": ("U8", (3,), b"abc")})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def numbers(records: list[Version]) -> list[int]:
    return [r.version for r in records]


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def verify(record: Version) -> None:
    """The record's bytes match its digest and are a valid safetensors file."""
    assert sha(bytes(record.data)) == record.sha256
    assert parse_header(record.data) == record.header


@pytest.fixture
def store() -> VersionStore:
    return VersionStore(keep=10)


# ---------------------------------------------------------------------------- publishing


def test_publish_assigns_one_two_three(store: VersionStore) -> None:
    records = [store.publish("policy", payload(i)) for i in range(3)]
    assert numbers(records) == [1, 2, 3]
    assert store.latest("policy") is records[-1]
    assert [store.get("policy", n).data for n in (1, 2, 3)] == [payload(0), payload(1), payload(2)]


def test_publish_record_fields(store: VersionStore) -> None:
    data = payload(7)
    before = time.time()
    record = store.publish("policy", data, metadata={"step": "100"}, sha256=sha(data), total_bytes=len(data))
    assert record.model == "policy"
    assert record.version == 1
    assert record.data == data
    assert record.byte_size == len(data)
    assert record.sha256 == sha(data)
    assert record.metadata == {"step": "100"}
    assert record.pinned is False
    assert before <= record.created <= time.time()
    assert [e.name for e in record.header.tensors] == ["w", "b"]
    verify(record)


def test_publish_copies_metadata(store: VersionStore) -> None:
    metadata = {"step": "1"}
    record = store.publish("policy", payload(1), metadata=metadata)
    metadata["step"] = "2"
    assert record.metadata == {"step": "1"}


def test_models_are_numbered_independently(store: VersionStore) -> None:
    assert store.publish("policy", payload(1)).version == 1
    assert store.publish("critic", payload(2)).version == 1
    assert store.publish("policy", payload(3)).version == 2
    infos = store.models()
    assert [(i.model, i.latest_version, i.version_count) for i in infos] == [("critic", 1, 1), ("policy", 2, 2)]
    assert infos[1].retained_bytes == len(payload(1)) + len(payload(3))


def test_requested_version_must_exceed_high_water(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    for requested in (1, 2):
        with pytest.raises(VersionConflict, match="latest version 2") as info:
            store.publish("policy", payload(9), version=requested)
        assert f"requested version {requested}" in str(info.value)
        with pytest.raises(VersionConflict, match="latest version 2"):
            store.check_publish("policy", total_bytes=10, version=requested)
    assert store.latest("policy").version == 2
    assert store.latest("policy").data == payload(2)
    assert store.publish("policy", payload(3), version=3).version == 3


def test_requested_versions_may_jump(store: VersionStore) -> None:
    assert store.publish("policy", payload(1), version=1).version == 1
    assert store.publish("policy", payload(10), version=10).version == 10
    assert store.publish("policy", payload(11)).version == 11
    with pytest.raises(VersionConflict, match="latest version 11"):
        store.publish("policy", payload(5), version=5)
    with pytest.raises(VersionNotFound, match="no version 5"):
        store.get("policy", 5)
    assert numbers(store.versions("policy")) == [1, 10, 11]


def test_first_publish_may_request_any_version(store: VersionStore) -> None:
    assert store.publish("policy", payload(1), version=42).version == 42
    store.check_publish("critic", total_bytes=1, version=1)  # no versions yet: anything goes


def test_negative_version_is_invalid(store: VersionStore) -> None:
    with pytest.raises(InvalidRequest, match="-1"):
        store.publish("policy", payload(1), version=-1)
    with pytest.raises(ModelNotFound):
        store.latest("policy")


def test_size_mismatch_is_integrity_error(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    data = payload(2)
    with pytest.raises(IntegrityError, match=f"declared {len(data) + 1} bytes but sent {len(data)}"):
        store.publish("policy", data, total_bytes=len(data) + 1)
    assert store.latest("policy").version == 1
    assert store.publish("policy", data, total_bytes=len(data)).version == 2


def test_sha256_mismatch_is_integrity_error(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    data = payload(2)
    wrong = sha(b"something else")
    with pytest.raises(IntegrityError, match="sha256") as info:
        store.publish("policy", data, sha256=wrong)
    assert wrong in str(info.value) and sha(data) in str(info.value)
    assert store.latest("policy").version == 1
    # The digest is compared case-insensitively.
    assert store.publish("policy", data, sha256=sha(data).upper()).version == 2


def test_over_max_model_bytes_is_model_too_large() -> None:
    data = payload(1)
    store = VersionStore(max_model_bytes=len(data))
    assert store.publish("policy", data).version == 1
    big = make_file({"w": ("U8", (len(data),), bytes(len(data)))})
    with pytest.raises(ModelTooLarge, match=f"limit of {len(data)} bytes") as info:
        store.publish("policy", big)
    assert str(len(big)) in str(info.value)
    with pytest.raises(ModelTooLarge):
        store.check_publish("policy", total_bytes=len(data) + 1)
    store.check_publish("policy", total_bytes=len(data))
    assert store.latest("policy").version == 1


@pytest.mark.parametrize(
    "data", [b"", b"\x00" * 7, b"not a safetensors file", make_file({"w": ("F32", (2,), bytes(8))}) + b"x"]
)
def test_malformed_bytes_are_invalid_safetensors(store: VersionStore, data: bytes) -> None:
    with pytest.raises(InvalidSafetensors):
        store.publish("policy", data)
    with pytest.raises(ModelNotFound):
        store.latest("policy")
    assert store.models() == []
    store.publish("policy", payload(1))
    with pytest.raises(InvalidSafetensors):
        store.publish("policy", data)
    assert store.latest("policy").version == 1


def test_store_header_limits_are_applied() -> None:
    three = make_file({f"t{i}": ("U8", (1,), b"x") for i in range(3)})
    with pytest.raises(InvalidSafetensors, match="limit of 2"):
        VersionStore(max_tensors=2).publish("policy", three)
    assert VersionStore(max_tensors=3).publish("policy", three).version == 1
    with pytest.raises(InvalidSafetensors, match="limit of 16"):
        VersionStore(max_header_bytes=16).publish("policy", three)


def test_failures_do_not_consume_version_numbers(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    data = payload(2)
    for kwargs in ({"total_bytes": 1}, {"sha256": "0" * 64}):
        with pytest.raises(IntegrityError):
            store.publish("policy", data, **kwargs)
    with pytest.raises(InvalidSafetensors):
        store.publish("policy", b"garbage!" * 4)
    with pytest.raises(VersionConflict):
        store.publish("policy", data, version=1)
    assert numbers(store.versions("policy")) == [1]
    assert store.publish("policy", data).version == 2


def test_failed_publishes_leave_no_files(tmp_path: Path) -> None:
    data = payload(1)
    store = VersionStore(tmp_path, max_model_bytes=len(data))
    store.publish("policy", data)
    before = files(tmp_path / "policy")
    for call in (
        lambda: store.publish("policy", data, total_bytes=1),
        lambda: store.publish("policy", data, sha256="0" * 64),
        lambda: store.publish("policy", b"garbage!"),
        lambda: store.publish("policy", data + b"x"),
        lambda: store.publish("policy", data, version=1),
        lambda: store.publish("critic", b"garbage!"),
    ):
        with pytest.raises((IntegrityError, InvalidSafetensors, ModelTooLarge, VersionConflict)):
            call()
    assert files(tmp_path / "policy") == before
    assert files(tmp_path) == ["policy"]


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep"):
        VersionStore(keep=0)


# ---------------------------------------------------------------------------- model names

INVALID_NAMES = [
    "",
    "a/b",
    "..",
    ".",
    ".hidden",
    "-x",
    "a" * 200,
    "a" * 129,
    "a\\b",
    "a\x00b",
    "a b",
    "a..b",
    "policy\n",
    "\npolicy",
    "a:b",
    "ü",
    "/abs",
]
VALID_NAMES = ["policy", "critic_v2", "a.b-c", "_x", "A9", "x", "a" * 128, "v1.2.3", "x-"]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_model_names(store: VersionStore, name: str) -> None:
    with pytest.raises(InvalidModelName) as info:
        validate_model_name(name)
    assert clipped_repr(name) in str(info.value)  # long names cut to their first 100 characters
    with pytest.raises(InvalidModelName):
        store.publish(name, payload(1))
    with pytest.raises(InvalidModelName):
        store.check_publish(name, total_bytes=1)
    for read in (store.latest, store.versions, lambda m: store.get(m, 1), lambda m: store.versions_after(m, 0)):
        with pytest.raises(InvalidModelName):
            read(name)
    assert store.models() == []


def test_non_string_model_name_is_invalid() -> None:
    with pytest.raises(InvalidModelName):
        validate_model_name(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_model_names(name: str, tmp_path: Path) -> None:
    assert validate_model_name(name) == name
    store = VersionStore(tmp_path)
    assert store.publish(name, payload(1)).version == 1
    assert (tmp_path / name / "000000000001.safetensors").is_file()
    assert store.latest(name).data == payload(1)


# ---------------------------------------------------------------------------- retention


def test_keep_evicts_oldest() -> None:
    store = VersionStore(keep=2)
    for i in range(1, 5):
        store.publish("policy", payload(i))
    assert numbers(store.versions("policy")) == [3, 4]
    for evicted in (1, 2):
        with pytest.raises(VersionEvicted, match="oldest retained is 3") as info:
            store.get("policy", evicted)
        assert f"version {evicted}" in str(info.value)
    assert store.get("policy", 3).data == payload(3)


def test_get_never_existing_version_lists_retained() -> None:
    store = VersionStore(keep=2)
    for i in range(1, 4):
        store.publish("policy", payload(i))
    for missing in (4, 99, 0, -1):
        with pytest.raises(VersionNotFound, match="retained versions: 2-3") as info:
            store.get("policy", missing)
        assert f"no version {missing}" in str(info.value)


def test_unknown_model_lists_models(store: VersionStore) -> None:
    with pytest.raises(ModelNotFound, match="none yet"):
        store.latest("policy")
    store.publish("policy", payload(1))
    store.publish("critic", payload(1))
    for call in (
        lambda: store.latest("actor"),
        lambda: store.get("actor", 1),
        lambda: store.versions("actor"),
        lambda: store.newer_than("actor", 0),
    ):
        with pytest.raises(ModelNotFound) as info:
            call()
        assert "'actor'" in str(info.value)
        assert "models: 'critic', 'policy'" in str(info.value)


def test_pinned_versions_survive_eviction() -> None:
    store = VersionStore(keep=2)
    store.publish("policy", payload(1), pin=True)
    for i in range(2, 6):
        store.publish("policy", payload(i))
    assert numbers(store.versions("policy")) == [1, 4, 5]
    assert store.get("policy", 1).pinned
    with pytest.raises(VersionEvicted, match="version 2"):
        store.get("policy", 2)


def test_set_pinned_keeps_a_version_beyond_keep() -> None:
    store = VersionStore(keep=2)
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    pinned = store.set_pinned("policy", 1, True)
    assert pinned.pinned and pinned.data == payload(1) and pinned.version == 1
    store.publish("policy", payload(3))
    store.publish("policy", payload(4))
    assert numbers(store.versions("policy")) == [1, 3, 4]
    assert store.get("policy", 1).pinned


def test_unpinning_evicts_at_once_when_beyond_keep() -> None:
    store = VersionStore(keep=2)
    store.publish("policy", payload(1), pin=True)
    store.publish("policy", payload(2), pin=True)
    store.publish("policy", payload(3))
    store.publish("policy", payload(4))
    assert numbers(store.versions("policy")) == [1, 2, 3, 4]
    unpinned = store.set_pinned("policy", 1, False)
    assert not unpinned.pinned
    assert numbers(store.versions("policy")) == [2, 3, 4]
    with pytest.raises(VersionEvicted):
        store.get("policy", 1)
    # Unpinning within the keep window evicts nothing.
    store.set_pinned("policy", 4, True)
    store.set_pinned("policy", 4, False)
    assert numbers(store.versions("policy")) == [2, 3, 4]


def test_unpinning_removes_files(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, keep=1)
    store.publish("policy", payload(1), pin=True)
    store.publish("policy", payload(2))
    assert "000000000001.safetensors" in files(tmp_path / "policy")
    store.set_pinned("policy", 1, False)
    assert files(tmp_path / "policy") == ["000000000002.json", "000000000002.safetensors"]


def test_eviction_removes_files(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, keep=2)
    for i in range(1, 5):
        store.publish("policy", payload(i))
    assert files(tmp_path / "policy") == [
        "000000000003.json",
        "000000000003.safetensors",
        "000000000004.json",
        "000000000004.safetensors",
    ]


# ---------------------------------------------------------------------------- delete


def test_deleted_version_is_not_found_saying_deleted(store: VersionStore) -> None:
    for i in range(1, 4):
        store.publish("policy", payload(i))
    deleted = store.delete("policy", 2)
    assert deleted.version == 2 and deleted.data == payload(2)
    with pytest.raises(VersionNotFound, match="version 2 was deleted") as info:
        store.get("policy", 2)
    assert "retained versions: 1, 3" in str(info.value)
    assert numbers(store.versions("policy")) == [1, 3]
    with pytest.raises(VersionNotFound, match="deleted"):
        store.delete("policy", 2)


def test_delete_unknown_or_evicted(store: VersionStore) -> None:
    with pytest.raises(ModelNotFound):
        store.delete("policy", 1)
    small = VersionStore(keep=1)
    small.publish("policy", payload(1))
    small.publish("policy", payload(2))
    with pytest.raises(VersionEvicted):
        small.delete("policy", 1)
    with pytest.raises(VersionNotFound):
        small.delete("policy", 7)
    assert numbers(small.versions("policy")) == [2]


def test_a_version_evicted_above_the_retained_ones_is_evicted_not_unknown() -> None:
    """v2 was evicted (keep 1, v1 pinned), then the latest, v3, deleted: v2 lies above every retained
    version. It was reported as never committed ("has no version 2", VersionNotFound), which a
    relay takes for a delete; it is VersionEvicted, as before the delete."""
    store = VersionStore(keep=1)
    store.publish("policy", payload(1), pin=True)
    store.publish("policy", payload(2))
    store.publish("policy", payload(3))  # evicts v2
    store.delete("policy", 3)
    assert numbers(store.versions("policy")) == [1]
    with pytest.raises(VersionEvicted, match="version 2 is no longer retained"):
        store.get("policy", 2)
    with pytest.raises(VersionNotFound, match="version 3 was deleted"):
        store.get("policy", 3)


def test_deleting_latest_keeps_numbering_monotonic(store: VersionStore) -> None:
    for i in range(1, 4):
        store.publish("policy", payload(i))
    store.delete("policy", 3)
    assert store.latest("policy").version == 2
    with pytest.raises(VersionConflict, match="latest version 3"):
        store.publish("policy", payload(9), version=3)
    with pytest.raises(VersionConflict, match="latest version 3"):
        store.check_publish("policy", total_bytes=1, version=3)
    assert store.publish("policy", payload(4)).version == 4


def test_deleting_every_version(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    store.delete("policy", 2)
    store.delete("policy", 1)
    with pytest.raises(ModelNotFound):
        store.latest("policy")
    assert store.models() == []
    assert store.versions_after("policy", 0) == ([], True)
    assert store.publish("policy", payload(3)).version == 3


def test_delete_removes_files_and_survives_reload(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for i in range(1, 4):
        store.publish("policy", payload(i))
    store.delete("policy", 2)
    store.delete("policy", 3)
    assert files(tmp_path / "policy") == ["000000000001.json", "000000000001.safetensors", "high_water.json"]
    assert json.loads((tmp_path / "policy" / "high_water.json").read_text()) == {"high_water": 3}

    reloaded = VersionStore(tmp_path)
    assert numbers(reloaded.versions("policy")) == [1]
    with pytest.raises(VersionConflict, match="latest version 3"):
        reloaded.publish("policy", payload(9), version=3)
    assert reloaded.publish("policy", payload(4)).version == 4
    assert numbers(VersionStore(tmp_path).versions("policy")) == [1, 4]


def test_deleting_every_version_survives_reload(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    store.delete("policy", 1)
    store.delete("policy", 2)
    reloaded = VersionStore(tmp_path)
    assert reloaded.models() == []
    assert reloaded.publish("policy", payload(3)).version == 3


def test_versions_of_more_than_twelve_digits_reload_in_number_order(tmp_path: Path) -> None:
    """File names pad numbers to 12 digits, so past 10^12 they sort as text out of number order
    ("1000000000000" before "999999999999"). The reload inserted the versions in name order, so
    `latest` answered the older one and the next publish evicted the newest."""
    store = VersionStore(tmp_path, keep=2)
    store.publish("policy", payload(1), version=999_999_999_999)
    store.publish("policy", payload(2))
    reloaded = VersionStore(tmp_path, keep=2)
    assert reloaded.latest("policy").version == 1_000_000_000_000
    assert numbers(reloaded.versions("policy")) == [999_999_999_999, 1_000_000_000_000]
    reloaded.publish("policy", payload(3))
    assert numbers(reloaded.versions("policy")) == [1_000_000_000_000, 1_000_000_000_001]


# ---------------------------------------------------------------------------- cursors


def test_versions_after_backlog_in_order(store: VersionStore) -> None:
    for i in range(1, 6):
        store.publish("policy", payload(i))
    backlog, gap = store.versions_after("policy", 2)
    assert numbers(backlog) == [3, 4, 5] and gap is False
    assert [r.data for r in backlog] == [payload(3), payload(4), payload(5)]
    assert (numbers(store.versions_after("policy", 0)[0]), store.versions_after("policy", 0)[1]) == (
        [1, 2, 3, 4, 5],
        False,
    )
    assert store.versions_after("policy", 5) == ([], False)


def test_versions_after_reports_gap_when_evicted() -> None:
    store = VersionStore(keep=2)
    for i in range(1, 6):
        store.publish("policy", payload(i))
    for since in (0, 1, 2):
        backlog, gap = store.versions_after("policy", since)
        assert numbers(backlog) == [4, 5] and gap is True, since
    for since, expected in ((3, [4, 5]), (4, [5]), (5, [])):
        backlog, gap = store.versions_after("policy", since)
        assert numbers(backlog) == expected and gap is False, since


def test_versions_after_reports_gap_when_deleted(store: VersionStore) -> None:
    for i in range(1, 5):
        store.publish("policy", payload(i))
    store.delete("policy", 2)
    assert (numbers(store.versions_after("policy", 1)[0]), store.versions_after("policy", 1)[1]) == ([3, 4], True)
    assert (numbers(store.versions_after("policy", 2)[0]), store.versions_after("policy", 2)[1]) == ([3, 4], False)
    store.delete("policy", 4)
    assert store.versions_after("policy", 3) == ([], True)


def test_missed_versions_are_a_gap_for_watchers_before_them(store: VersionStore) -> None:
    """A relay's store: versions of its upstream it will never hold (`missed`) are a gap, as
    evicted and deleted ones are, for a backlog (`versions_after`) and between two events
    (`gap_between`)."""
    store.publish("policy", payload(1))
    store.missed("policy", 30)  # v2..v30 gone upstream before the relay fetched them
    store.publish("policy", payload(31), version=31)
    assert (numbers(store.versions_after("policy", 1)[0]), store.versions_after("policy", 1)[1]) == ([31], True)
    assert store.versions_after("policy", 30) == (store.versions_after("policy", 30)[0], False)
    assert store.gap_between("policy", 1, 31) is True
    assert store.gap_between("policy", 30, 31) is False
    assert store.gap_between("policy", 31, 32) is False
    assert store.gap_between("unknown", 0, 5) is False
    store.publish("policy", payload(32))
    store.delete("policy", 32)
    store.publish("policy", payload(33))
    assert store.gap_between("policy", 31, 33) is True  # deleted counts too


def test_a_version_removed_as_evicted_elsewhere_is_reported_evicted(store: VersionStore) -> None:
    for i in range(1, 4):
        store.publish("policy", payload(i))
    store.delete("policy", 2, evicted=True)  # a relay whose upstream evicted it
    with pytest.raises(VersionEvicted):  # between retained versions: as evicted, not deleted
        store.get("policy", 2)
    store.delete("policy", 1)
    with pytest.raises(VersionNotFound, match="deleted"):
        store.get("policy", 1)
    assert store.versions_after("policy", 1) == (store.versions_after("policy", 1)[0], True)


def test_versions_after_reports_gap_behind_a_pinned_version() -> None:
    # Version 1 is pinned and returned, but version 2 after it was evicted: the backlog has a hole.
    store = VersionStore(keep=1)
    store.publish("policy", payload(1), pin=True)
    store.publish("policy", payload(2))
    store.publish("policy", payload(3))
    backlog, gap = store.versions_after("policy", 0)
    assert numbers(backlog) == [1, 3]
    assert gap is True
    assert (numbers(store.versions_after("policy", 2)[0]), store.versions_after("policy", 2)[1]) == ([3], False)


def test_versions_after_no_gap_across_requested_jumps(store: VersionStore) -> None:
    store.publish("policy", payload(1), version=1)
    store.publish("policy", payload(10), version=10)
    backlog, gap = store.versions_after("policy", 1)
    assert numbers(backlog) == [10] and gap is False


def test_versions_after_cursor_ahead_is_out_of_range(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    with pytest.raises(CursorOutOfRange, match="since=3 is ahead of the latest version 2"):
        store.versions_after("policy", 3)


def test_versions_after_unknown_model(store: VersionStore) -> None:
    assert store.versions_after("policy", 0) == ([], False)
    # A cursor from before an in-memory restart must not wait silently past versions 1-5.
    with pytest.raises(CursorOutOfRange, match="since=5 is ahead of the latest version 0"):
        store.versions_after("policy", 5)


def test_newer_than(store: VersionStore) -> None:
    store.publish("policy", payload(1))
    assert store.newer_than("policy", 1) is None
    second = store.publish("policy", payload(2))
    assert store.newer_than("policy", 0) is second
    assert store.newer_than("policy", 1) is second
    assert store.newer_than("policy", 2) is None
    with pytest.raises(CursorOutOfRange, match="version 3 is ahead of the latest version 2"):
        store.newer_than("policy", 3)
    with pytest.raises(ModelNotFound):
        store.newer_than("critic", 0)


def test_newer_than_a_deleted_latest_version_says_it_was_deleted(store: VersionStore) -> None:
    """A collector holding a version deleted since (a bad one rolled back) asks for a newer one: the
    OUT_OF_RANGE message blamed a restart without --data-dir or another server, neither of which
    happened; it now says the versions after the latest were deleted."""
    store.publish("policy", payload(1))
    store.publish("policy", payload(2))
    store.delete("policy", 2)
    with pytest.raises(CursorOutOfRange, match="version 2 is ahead of the latest version 1") as caught:
        store.newer_than("policy", 2)
    assert "up to 2, were deleted" in str(caught.value) and "restarted" not in str(caught.value)


# ---------------------------------------------------------------------------- listeners


def test_subscribe_is_called_after_commit(store: VersionStore) -> None:
    seen: list[tuple[Commit, Version]] = []

    def listener(commit: Commit) -> None:
        # The version is already visible when the listener runs.
        [record] = commit.versions
        seen.append((commit, store.get(record.model, record.version)))

    unsubscribe = store.subscribe(listener)
    first = store.publish("policy", payload(1))
    second = store.publish("critic", payload(2))
    assert [(c.versions[0].version, c.versions[0].model) for c, _ in seen] == [(1, "policy"), (1, "critic")]
    assert seen[0][1] == first and seen[1][1] == second
    assert all(c.visible and not c.replayed and c.evicted == () for c, _ in seen)
    with pytest.raises(IntegrityError):
        store.publish("policy", payload(3), total_bytes=1)
    assert len(seen) == 2  # failed publishes notify nobody

    unsubscribe()
    store.publish("policy", payload(3))
    assert len(seen) == 2
    unsubscribe()  # a second unsubscribe is harmless


def test_multiple_listeners(store: VersionStore) -> None:
    a: list[int] = []
    b: list[int] = []
    unsubscribe_a = store.subscribe(lambda c: a.append(c.versions[0].version))
    store.subscribe(lambda c: b.append(c.versions[0].version))
    store.publish("policy", payload(1))
    unsubscribe_a()
    store.publish("policy", payload(2))
    assert a == [1] and b == [1, 2]


def test_a_commit_event_names_a_group_and_what_it_evicted() -> None:
    store = VersionStore(keep=1)
    heard: list[Commit] = []
    store.subscribe(heard.append)
    store.publish_group([Upload("policy", payload(1)), Upload("critic", payload(2))], publish_id="g1")
    second = store.publish_group([Upload("policy", payload(3)), Upload("critic", payload(4))], publish_id="g2")
    assert len(heard) == 2  # one event per commit, the group's versions in the uploads' order
    assert heard[1].versions == tuple(second) and heard[1].publish_id == "g2"
    assert [(v.model, v.version) for v in heard[1].evicted] == [("policy", 1), ("critic", 1)]


def test_the_commit_body_runs_before_any_reader_sees_the_version(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    hooked: list[tuple[Version, list, bool, bool]] = []
    heard: list[int] = []
    store.subscribe(lambda commit: heard.append(len(hooked)))
    with store.commit([Upload("policy", payload(1))]) as commit:
        [record] = commit.versions
        durable = (tmp_path / "policy" / f"{record.version:012d}.json").exists()
        hooked.append((record, store.models(), durable, commit.visible))
    assert hooked == [(record, [], True, False)]  # durable, not yet readable
    assert heard == [1]  # listeners hear of it after the body ran
    assert store.latest("policy") == record
    with pytest.raises(IntegrityError), store.commit([Upload("policy", payload(2), total_bytes=1)]):
        hooked.append(None)  # type: ignore[arg-type]
    assert len(hooked) == 1  # a publish that fails runs no body


def test_a_repeated_publish_id_is_a_replayed_commit_that_nobody_hears_of(store: VersionStore) -> None:
    heard: list[Commit] = []
    store.subscribe(heard.append)
    first = store.publish("policy", payload(1), publish_id="once")
    with store.commit([Upload("policy", payload(1))], publish_id="once") as commit:
        assert commit.replayed and commit.versions == (first,)
    assert len(heard) == 1 and not heard[0].replayed
    assert numbers(store.versions("policy")) == [1]


def test_a_failing_commit_body_or_listener_is_logged_and_the_commit_stands(store: VersionStore, caplog) -> None:
    def listener(commit: Commit) -> None:
        raise RuntimeError("listener down")

    store.subscribe(listener)
    with caplog.at_level(logging.ERROR, logger=STORE_LOGGER), store.commit([Upload("policy", payload(1))]) as commit:
        raise OSError("no room")
    assert store.latest("policy") == commit.versions[0]
    assert _logged(caplog, logging.ERROR, "failed on policy v1")
    assert sum("failed on policy v1" in r.getMessage() for r in caplog.records) == 2  # the body, the listener


# ---------------------------------------------------------------------------- persistence


def _populate(path: Path, count: int = 3, **kwargs) -> VersionStore:
    store = VersionStore(path, **kwargs)
    for i in range(1, count + 1):
        store.publish("policy", payload(i), metadata={"step": str(i * 10)})
    return store


def test_reload_restores_versions_exactly(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, keep=2)
    store.publish("policy", payload(1), metadata={"step": "10"}, pin=True)
    store.publish("policy", payload(2), metadata={"step": "20", "note": "héllo"})
    store.publish("policy", payload(3))
    store.publish("critic", make_file({"v": ("F64", (), bytes(8))}, {"k": "v"}))
    originals = {(r.model, r.version): r for m in ("policy", "critic") for r in store.versions(m)}
    assert set(originals) == {("policy", 1), ("policy", 2), ("policy", 3), ("critic", 1)}

    reloaded = VersionStore(tmp_path, keep=2)
    loaded = {(r.model, r.version): r for m in ("policy", "critic") for r in reloaded.versions(m)}
    assert set(loaded) == set(originals)
    for key, original in originals.items():
        record = loaded[key]
        assert bytes(record.data) == bytes(original.data)
        assert record.sha256 == original.sha256
        assert record.metadata == original.metadata
        assert record.pinned == original.pinned
        assert record.created == original.created
        assert record.header == original.header
        verify(record)
    assert [(i.model, i.latest_version, i.version_count) for i in reloaded.models()] == [
        ("critic", 1, 1),
        ("policy", 3, 3),
    ]
    assert reloaded.publish("policy", payload(4)).version == 4


def test_on_disk_layout_and_manifest(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    record = store.publish("policy", payload(1), metadata={"step": "5"}, pin=True)
    directory = tmp_path / "policy"
    assert files(directory) == ["000000000001.json", "000000000001.safetensors"]
    assert (directory / "000000000001.safetensors").read_bytes() == payload(1)
    manifest = json.loads((directory / "000000000001.json").read_text())
    assert manifest == {
        "format": 1,
        "model": "policy",
        "version": 1,
        "byte_size": len(payload(1)),
        "sha256": record.sha256,
        "created": record.created,
        "metadata": {"step": "5"},
        "pinned": True,
        "group": [],
    }
    store.set_pinned("policy", 1, False)
    assert json.loads((directory / "000000000001.json").read_text())["pinned"] is False
    assert not list(directory.glob("*.tmp"))


def test_keep_applied_on_reload(tmp_path: Path) -> None:
    _populate(tmp_path, 4, keep=10)
    reloaded = VersionStore(tmp_path, keep=2)
    assert numbers(reloaded.versions("policy")) == [3, 4]
    with pytest.raises(VersionEvicted):
        reloaded.get("policy", 1)
    assert sorted(p.name for p in (tmp_path / "policy").glob("*.safetensors")) == [
        "000000000003.safetensors",
        "000000000004.safetensors",
    ]
    assert reloaded.publish("policy", payload(5)).version == 5


def test_pinned_survive_reload_with_smaller_keep(tmp_path: Path) -> None:
    store = _populate(tmp_path, 4, keep=10)
    store.set_pinned("policy", 1, True)
    reloaded = VersionStore(tmp_path, keep=1)
    assert numbers(reloaded.versions("policy")) == [1, 4]
    assert reloaded.get("policy", 1).pinned


def _damage_and_reload(tmp_path: Path, damage, caplog) -> VersionStore:
    _populate(tmp_path, 3)
    damage(tmp_path / "policy")
    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        reloaded = VersionStore(tmp_path)
    return reloaded


def _assert_others_fine(store: VersionStore, expected: list[int]) -> None:
    records = store.versions("policy")
    assert numbers(records) == expected
    for record in records:
        assert bytes(record.data) == payload(record.version)
        assert record.metadata == {"step": str(record.version * 10)}
        verify(record)


def _logged(caplog, level: int, *fragments: str) -> bool:
    return any(
        r.name.startswith(STORE_LOGGER) and r.levelno >= level and all(f in r.getMessage() for f in fragments)
        for r in caplog.records
    )


def test_reload_skips_torn_data_file(tmp_path: Path, caplog) -> None:
    def truncate(directory: Path) -> None:
        path = directory / "000000000002.safetensors"
        path.write_bytes(path.read_bytes()[:-5])

    store = _damage_and_reload(tmp_path, truncate, caplog)
    _assert_others_fine(store, [1, 3])
    assert _logged(caplog, logging.ERROR, "000000000002.safetensors", "skipping")
    with pytest.raises(VersionNotFound):
        store.get("policy", 2)


def test_reload_skips_corrupted_byte(tmp_path: Path, caplog) -> None:
    def flip(directory: Path) -> None:
        path = directory / "000000000002.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    store = _damage_and_reload(tmp_path, flip, caplog)
    _assert_others_fine(store, [1, 3])
    assert _logged(caplog, logging.ERROR, "000000000002.safetensors", "sha256")


def test_reload_skips_invalid_safetensors_with_matching_manifest(tmp_path: Path, caplog) -> None:
    def rewrite(directory: Path) -> None:
        bad = b"this is not safetensors"
        (directory / "000000000002.safetensors").write_bytes(bad)
        manifest_path = directory / "000000000002.json"
        manifest = json.loads(manifest_path.read_text())
        manifest.update(byte_size=len(bad), sha256=sha(bad))
        manifest_path.write_text(json.dumps(manifest))

    store = _damage_and_reload(tmp_path, rewrite, caplog)
    _assert_others_fine(store, [1, 3])
    assert _logged(caplog, logging.ERROR, "000000000002.safetensors")


def test_reload_skips_manifest_without_data(tmp_path: Path, caplog) -> None:
    store = _damage_and_reload(tmp_path, lambda d: (d / "000000000002.safetensors").unlink(), caplog)
    _assert_others_fine(store, [1, 3])
    assert _logged(caplog, logging.ERROR, "000000000002.safetensors", "skipping")


def test_reload_removes_data_without_manifest(tmp_path: Path, caplog) -> None:
    store = _damage_and_reload(tmp_path, lambda d: (d / "000000000002.json").unlink(), caplog)
    _assert_others_fine(store, [1, 3])
    assert not (tmp_path / "policy" / "000000000002.safetensors").exists()
    assert _logged(caplog, logging.WARNING, "000000000002.safetensors", "without a manifest")


def test_reload_removes_leftover_tmp_files(tmp_path: Path, caplog) -> None:
    def leave_tmp(directory: Path) -> None:
        (directory / "000000000004.safetensors.tmp").write_bytes(payload(4)[:10])
        (directory / "000000000003.json.tmp").write_text("{")

    store = _damage_and_reload(tmp_path, leave_tmp, caplog)
    _assert_others_fine(store, [1, 2, 3])
    assert not list((tmp_path / "policy").glob("*.tmp"))
    assert _logged(caplog, logging.WARNING, "000000000004.safetensors.tmp", "unfinished write")
    assert _logged(caplog, logging.WARNING, "000000000003.json.tmp")
    assert store.publish("policy", payload(4)).version == 4


@pytest.mark.parametrize("garbage", ["{not json", "", "[]", '{"version": 2}', "null"])
def test_reload_skips_garbage_manifest(tmp_path: Path, caplog, garbage: str) -> None:
    store = _damage_and_reload(tmp_path, lambda d: (d / "000000000002.json").write_text(garbage), caplog)
    _assert_others_fine(store, [1, 3])
    assert _logged(caplog, logging.ERROR, "000000000002", "skipping")


def test_reload_with_corrupt_latest_does_not_reuse_its_number(tmp_path: Path, caplog) -> None:
    # Version 3 was committed (its manifest exists); clients may have seen it. Even though its
    # bytes are damaged now, the next publish must not be given number 3 again.
    def truncate(directory: Path) -> None:
        path = directory / "000000000003.safetensors"
        path.write_bytes(path.read_bytes()[:4])

    store = _damage_and_reload(tmp_path, truncate, caplog)
    _assert_others_fine(store, [1, 2])
    assert _logged(caplog, logging.ERROR, "000000000003.safetensors")
    with pytest.raises(VersionConflict):
        store.publish("policy", payload(9), version=3)
    assert store.publish("policy", payload(4)).version == 4


def test_reload_ignores_odd_file_names(tmp_path: Path, caplog) -> None:
    _populate(tmp_path, 2)
    (tmp_path / "policy" / "\u00b2.json").write_text("{}")  # a unicode digit, not a version number
    (tmp_path / "policy" / "notes.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        store = VersionStore(tmp_path)
    assert numbers(store.versions("policy")) == [1, 2]
    assert store.publish("policy", payload(3)).version == 3


def test_reload_ignores_invalid_model_directories(tmp_path: Path, caplog) -> None:
    _populate(tmp_path, 1)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "bad name").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        store = VersionStore(tmp_path)
    assert [i.model for i in store.models()] == ["policy"]
    assert _logged(caplog, logging.WARNING, "bad name", "not a valid model name")
    assert _logged(caplog, logging.WARNING, ".hidden")
    assert _logged(caplog, logging.INFO, "loaded model 'policy'", "versions 1")


def test_reload_with_garbage_high_water(tmp_path: Path, caplog) -> None:
    store = _populate(tmp_path, 2)
    store.delete("policy", 2)
    (tmp_path / "policy" / "high_water.json").write_text("{garbage")
    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        reloaded = VersionStore(tmp_path)
    _assert_others_fine(reloaded, [1])
    assert _logged(caplog, logging.ERROR, "high_water.json")


def test_crash_between_data_and_manifest(tmp_path: Path, caplog, monkeypatch) -> None:
    import weightserver.storage.persistence as store_module

    store = _populate(tmp_path, 1)
    real_write = store_module.atomic_write

    def failing_write(path: Path, data) -> None:
        if path.suffix == ".json":
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(store_module, "atomic_write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        store.publish("policy", payload(2))
    assert numbers(store.versions("policy")) == [1]
    assert store.newer_than("policy", 1) is None
    monkeypatch.setattr(store_module, "atomic_write", real_write)
    # The failed write removed the data file it had written; a crash there would have left it.
    data_path = tmp_path / "policy" / "000000000002.safetensors"
    assert not data_path.exists()
    data_path.write_bytes(payload(2))

    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        reloaded = VersionStore(tmp_path)
    _assert_others_fine(reloaded, [1])
    assert _logged(caplog, logging.WARNING, "000000000002.safetensors", "without a manifest")
    assert not (tmp_path / "policy" / "000000000002.safetensors").exists()
    assert reloaded.publish("policy", payload(2)).version == 2


def test_data_dir_is_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    VersionStore(target).publish("policy", payload(1))
    assert (target / "policy" / "000000000001.safetensors").is_file()


# ---------------------------------------------------------------------------- thread safety


@pytest.mark.parametrize("persist", [False, True])
def test_concurrent_publishers_get_distinct_versions(tmp_path: Path, persist: bool) -> None:
    threads_n, per_thread = 8, 5
    store = VersionStore(tmp_path if persist else None, keep=threads_n * per_thread)
    barrier = threading.Barrier(threads_n)
    results: list[list[Version]] = [[] for _ in range(threads_n)]
    errors: list[BaseException] = []

    def publisher(index: int) -> None:
        try:
            barrier.wait()
            for j in range(per_thread):
                n = index * 100 + j
                results[index].append(store.publish("policy", payload(n), metadata={"n": str(n)}))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    total = threads_n * per_thread
    assigned = sorted(r.version for rs in results for r in rs)
    assert assigned == list(range(1, total + 1))
    for rs in results:
        assert numbers(rs) == sorted(numbers(rs))  # each thread's versions increase
    for record in store.versions("policy"):
        assert bytes(record.data) == payload(int(record.metadata["n"]))
        verify(record)
    if persist:
        reloaded = VersionStore(tmp_path, keep=total)
        assert numbers(reloaded.versions("policy")) == list(range(1, total + 1))


def test_concurrent_requested_version_only_one_wins(store: VersionStore) -> None:
    threads_n = 8
    barrier = threading.Barrier(threads_n)
    outcomes: list[object] = []
    lock = threading.Lock()

    def publisher(index: int) -> None:
        barrier.wait()
        try:
            result: object = store.publish("policy", payload(index), version=5)
        except VersionConflict as exc:
            result = exc
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winners = [o for o in outcomes if isinstance(o, Version)]
    assert len(outcomes) == threads_n
    assert len(winners) == 1 and winners[0].version == 5
    assert all(isinstance(o, VersionConflict) for o in outcomes if o is not winners[0])
    assert numbers(store.versions("policy")) == [5]


def test_concurrent_readers_only_see_verified_versions(tmp_path: Path) -> None:
    store = VersionStore(tmp_path, keep=2)
    store.publish("policy", payload(0), metadata={"n": "0"})
    stop = threading.Event()
    errors: list[BaseException] = []
    checks = [0] * 4

    def check(record: Version) -> None:
        verify(record)
        assert bytes(record.data) == payload(int(record.metadata["n"]))

    def reader(index: int) -> None:
        last = 0
        try:
            while not stop.is_set():
                latest = store.latest("policy")
                check(latest)
                assert latest.version >= last
                last = latest.version
                for record in store.versions("policy"):
                    check(record)
                backlog, _ = store.versions_after("policy", max(0, last - 3))
                for record in backlog:
                    check(record)
                with contextlib.suppress(VersionEvicted, VersionNotFound):
                    check(store.get("policy", max(1, last - 1)))
                checks[index] += 1
                time.sleep(0.0005)  # let the publishers make progress under the GIL
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def publisher(index: int) -> None:
        try:
            for j in range(5):
                n = 1 + index * 100 + j
                store.publish("policy", payload(n), metadata={"n": str(n)})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    publishers = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    for t in readers + publishers:
        t.start()
    for t in publishers:
        t.join(timeout=30)
    wait_until(lambda: all(checks) or errors, timeout=10, step=0.001, what="every reader's checks, or an error")
    stop.set()
    for t in readers:
        t.join(timeout=30)
    assert not errors, errors
    assert all(checks)
    assert store.latest("policy").version == 21
    assert numbers(store.versions("policy")) == [20, 21]


def test_a_publish_id_commits_once_and_is_kept_in_the_manifest(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    heard: list[int] = []
    store.subscribe(lambda commit: heard.extend(r.version for r in commit.versions))
    first = store.publish("policy", payload(1), publish_id="run-1/step-100")
    assert store.publish("policy", payload(1), publish_id="run-1/step-100") is first
    assert heard == [1]  # a repeat commits nothing, so nobody hears of it
    manifest = json.loads((tmp_path / "policy" / "000000000001.json").read_text())
    assert manifest["publish_id"] == "run-1/step-100"
    reloaded = VersionStore(tmp_path)
    # After a restart too, and a repeat that asked for an explicit number gets it back.
    again = reloaded.publish("policy", payload(1), publish_id="run-1/step-100", version=1)
    assert (again.version, again.sha256, again.created) == (1, first.sha256, first.created)
    assert numbers(reloaded.versions("policy")) == [1]
    for bad in ("has space", "x" * 129, "é"):
        with pytest.raises(InvalidRequest, match="invalid publish id"):
            reloaded.publish("policy", payload(2), publish_id=bad)
