"""Selections without sockets: the rules as the proto documents them (matching, torch.chunk shards,
ranges, disagreement, every refusal naming what is at fault), their wire form, and the selection's
file cut from a version bit for bit."""

from __future__ import annotations

import itertools
import pickle
import re
import time
from pathlib import Path

import pytest
import torch

from weightclient import tensors as tensor_codec
from weightserver.protocol.errors import InvalidRequest
from weightserver.protocol.limits import MAX_SELECTION_RULES
from weightserver.protocol.safetensors_format import TensorEntry, parse_header
from weightserver.protocol.selection import LLAMA_PLAN, Selection, TensorRule, shard_bounds, tensor_parallel
from weightserver.storage.payloads import PayloadCache, select_file
from weightserver.v1 import weights_pb2 as pb


def entries(**shapes: tuple[int, ...]) -> list[TensorEntry]:
    return [TensorEntry(name, "F32", shape, 0, 0) for name, shape in shapes.items()]


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 9, 250])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_are_torch_chunk_and_cover_the_dimension_once(size, world):
    chunks = torch.arange(size).chunk(world) if size else ()
    bounds = [shard_bounds(size, rank, world) for rank in range(world)]
    assert [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()] == [b for b in bounds if b[0] < b[1]]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, in order


@pytest.mark.parametrize(
    ("rule", "name", "matches"),
    [
        (TensorRule("*.q_proj.weight"), "model.layers.0.self_attn.q_proj.weight", True),
        (TensorRule("*.q_proj.weight"), "q_proj.weight", False),
        (TensorRule("layers.?.w"), "layers.1.w", True),
        (TensorRule("layers.?.w"), "layers.10.w", False),
        (TensorRule("a+b[0]"), "a+b[0]", True),  # no character but * and ? is special
        (TensorRule("a+b[0]"), "ab0", False),
        (TensorRule("model.", "prefix"), "model.norm.weight", True),
        (TensorRule("model.norm.weight", "name"), "model.norm.weight", True),
        (TensorRule("model.norm", "name"), "model.norm.weight", False),
    ],
)
def test_rules_match_names_as_documented(rule, name, matches):
    assert rule.matches(name) is matches


def test_a_glob_of_many_stars_matches_in_linear_time():
    """A client's glob is matched against every tensor name on the server's event loop. Before, a
    glob was one regex whose '.*'s backtracked exponentially: nine stars against a 53-character
    name took 5 to 15 s (ten: 40 s), in which the server answered no call at all."""
    rule, name = TensorRule("*a" * 9 + "*b"), "model.layers." + "a" * 40
    started = time.perf_counter()
    assert not rule.matches(name) and rule.matches(name + "b")
    assert time.perf_counter() - started < 1.0


def test_a_selection_pickles_and_matches_the_same_names_after():
    """A selection travels to other processes pickled: a torchrl scheme's updater to its collector
    workers, a rank's plan to its process. Since globs were matched by a closure, a selection with
    a glob could not be pickled ("Can't pickle local object '_glob.<locals>.matches'")."""
    selection = Selection((*tensor_parallel(1, 4, LLAMA_PLAN).rules, TensorRule("lm_head?weight")), rest=True)
    copied = pickle.loads(pickle.dumps(selection))
    assert copied == selection
    names = ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "lm_headweight", "model.norm.weight"]
    for name in names:
        assert [rule.matches(name) for rule in copied.rules] == [rule.matches(name) for rule in selection.rules]


def test_overlapping_rules_that_agree_select_once_and_whole_equals_a_shard_of_one():
    tensors = entries(a=(4, 6), b=(6,))
    rules = (TensorRule("*"), TensorRule("a", "name", dim=0, shard=(0, 1)), TensorRule("a", dim=1, span=(0, 6)))
    assert Selection(rules).resolve(tensors).cuts == {"a": None, "b": None}
    assert Selection(rules).resolve(tensors).key == ""  # every tensor whole: the version itself


def test_a_plan_selects_its_shards_and_the_rest_whole():
    tensors = entries(**{"l.q_proj.weight": (8, 4), "l.o_proj.weight": (4, 8), "norm.weight": (4,)})
    plan = {"*.q_proj.weight": 0, "*.o_proj.weight": 1}
    cuts = tensor_parallel(1, 4, plan).resolve(tensors).cuts
    assert cuts == {"l.q_proj.weight": (0, 2, 4), "l.o_proj.weight": (1, 2, 4), "norm.weight": None}
    without_rest = tensor_parallel(1, 4, {"*.q_proj.weight": 0}, rest=False).resolve(tensors)
    assert list(without_rest.cuts) == ["l.q_proj.weight"]
    with pytest.raises(InvalidRequest, match=re.escape("rule glob 'lm_head.weight' dim 0 shard 1/4 matches no tensor")):
        tensor_parallel(1, 4, LLAMA_PLAN).resolve(tensors)  # a plan must fit the model


def test_the_key_is_canonical_for_what_is_selected():
    tensors = entries(a=(4, 6), b=(6,))
    one = Selection((TensorRule("a", "name", dim=0, shard=(1, 2)),)).resolve(tensors)
    other = Selection((TensorRule("?", dim=0, span=(2, 4)), TensorRule("b", "prefix", dim=0, span=(2, 4))))
    assert Selection((TensorRule("a", dim=0, span=(2, 4)),)).resolve(tensors).key == one.key != ""
    assert other.resolve(tensors).key != one.key  # (b is selected too)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ((TensorRule("nothing.*"),), "rule glob 'nothing.*' matches no tensor"),
        ((TensorRule("a", dim=2, shard=(0, 2)),), "dim 2 out of range"),
        ((TensorRule("b", dim=0, span=(3, 9)),), "range [3, 9) is not within [0, 6]"),
        ((TensorRule("a", dim=0, shard=(0, 2)), TensorRule("*", dim=1, shard=(0, 2))), "disagree on tensor 'a'"),
        ((TensorRule("s", dim=0, shard=(0, 2)),), "on tensor 's' of shape []: dim 0 out of range"),
    ],
)
def test_a_selection_that_does_not_fit_names_the_rule_and_tensor(rules, message):
    with pytest.raises(InvalidRequest, match="select: .*" + re.escape(message)):
        Selection(rules).resolve(entries(a=(4, 6), b=(6,), s=()))


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (pb.TensorRule(glob="a", slice=pb.Slice(dim=0, shard=pb.Shard(rank=2, world=2))), "0 <= rank < world"),
        (pb.TensorRule(glob="a", slice=pb.Slice(dim=0, shard=pb.Shard(rank=0, world=0))), "world >= 1"),
        (pb.TensorRule(slice=pb.Slice(dim=0)), "sets none of name, prefix or glob"),
        (pb.TensorRule(name="a", slice=pb.Slice(dim=0)), "sets neither shard nor range"),
    ],
)
def test_a_malformed_rule_on_the_wire_is_refused(rule, message):
    with pytest.raises(InvalidRequest, match=message):
        Selection.from_message(pb.Selection(rules=[rule]))


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"dim": -1, "shard": (0, 2)}, "dim -1"), ({"dim": 0, "span": (-2, 2)}, r"range \[-2, 2\)")],
)
def test_a_negative_dim_or_index_is_refused_as_a_request_naming_it(settings, message):
    """dim=-1 (torch's "the last dimension") and negative indices have no wire form (uint fields).
    Before, the rule was taken and the fetch that sent it raised protobuf's bare ValueError
    ("Value out of range: -1"), naming neither the rule nor what to change."""
    with pytest.raises(InvalidRequest, match=f"rule glob 'w'.*{message}.*count from 0"):
        Selection((TensorRule("w", **settings),)).message()


def test_a_selection_holds_at_most_max_selection_rules_here_and_on_the_wire():
    """A selection of more than MAX_SELECTION_RULES (1,024) rules is refused, naming the count and
    the limit: built here (a client's, before anything is sent) and read off the wire (the server's,
    before a rule is built or matched). Before, any number was taken, and the server matched every
    rule against every tensor name on its event loop: one request of 8 MiB of rules stalled it."""
    assert MAX_SELECTION_RULES == 1024
    names = [f"t{i}" for i in range(MAX_SELECTION_RULES + 1)]
    most = Selection.of(names[:-1])
    assert Selection.from_message(most.message()) == most  # the limit itself is taken
    refusal = f"select: {MAX_SELECTION_RULES + 1} rules, over the limit of {MAX_SELECTION_RULES}"
    with pytest.raises(InvalidRequest, match=refusal):
        Selection.of(names)
    with pytest.raises(InvalidRequest, match=refusal):
        Selection(tuple(TensorRule(name, "name") for name in names), rest=True)
    with pytest.raises(InvalidRequest, match=refusal):
        Selection.from_message(pb.Selection(rules=[pb.TensorRule(name=name) for name in names]))
    huge = pb.Selection(rules=[pb.TensorRule(name=f"t{i}") for i in range(200_000)])
    with pytest.raises(InvalidRequest, match="select: 200000 rules, over the limit"):
        Selection.from_message(huge)


def test_the_proto_documents_the_selection_rule_limit():
    proto = (Path(__file__).parents[2] / "protos/weightserver/v1/weights.proto").read_text()
    comment = proto.split("message Selection {", 1)[1].split("repeated TensorRule rules", 1)[0]
    assert f"At most {MAX_SELECTION_RULES:,} of them" in comment


def test_an_empty_selection_selects_nothing_and_is_refused():
    with pytest.raises(InvalidRequest, match="selects no tensor"):
        Selection().resolve(entries(a=(2,)))


def test_the_wire_form_round_trips():
    selection = Selection(
        (TensorRule("x", "name"), TensorRule("p.", "prefix", dim=1, span=(3, 5)), TensorRule("*", dim=0, shard=(1, 3))),
        rest=True,
    )
    assert Selection.from_message(pb.Selection.FromString(selection.message().SerializeToString())) == selection
    assert Selection.of(["a.*", "b"]) == Selection((TensorRule("a.*"), TensorRule("b")))


def version(tensors: dict[str, torch.Tensor]) -> tuple[memoryview, object]:
    data = memoryview(b"".join(tensor_codec.encode(tensors)))
    return data, parse_header(data)


def test_the_selection_file_holds_each_slice_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    full = {
        "w3": torch.randn(3, 5, 7, generator=generator),
        "h": torch.randn(9, 4, generator=generator).to(torch.bfloat16),
        "ones": torch.randn(1, 6, generator=generator).to(torch.float64),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    data, header = version(full)
    cuts = {"w3": (1, 2, 5), "h": (0, 7, 9), "ones": (1, 0, 2), "scalar": None, "empty": (1, 1, 3)}
    pieces, out_header = select_file(data, header, cuts)
    out = memoryview(bytearray(b"".join(pieces.views)))
    assert parse_header(out) == out_header
    got = tensor_codec.decode(out_header, out)
    assert torch.equal(got["w3"], full["w3"][:, 2:5])
    assert torch.equal(got["h"], full["h"][7:9])
    assert torch.equal(got["ones"], full["ones"][:, 0:2])
    assert torch.equal(got["scalar"], full["scalar"]) and got["empty"].shape == (0, 2)
    names = [t.name for t in out_header.tensors]  # largest elements first, then by name
    assert names == ["ones", "scalar", "empty", "w3", "h"]
    # A whole tensor and a cut whose leading dimensions are 1 are byte ranges of the version's file
    # (views, nothing copied); the others were gathered: only those and the header are the file's own.
    ranges = {name for name, piece in zip(names, pieces.views[1:], strict=True) if _views(piece, data)}
    assert ranges == {"ones", "scalar", "h"}
    gathered = out_header.data_start + sum(t.nbytes for t in out_header.tensors if t.name in {"w3", "empty"})
    assert pieces.owned == gathered and pieces.nbytes == len(out)
    for t in out_header.tensors:  # each tensor's bytes, read back through the pieces
        assert (
            bytes(pieces.span(out_header.data_start + t.begin, out_header.data_start + t.end))
            == out[out_header.data_start + t.begin : out_header.data_start + t.end]
        )


def _views(piece: memoryview, data: memoryview) -> bool:
    """Whether `piece` lies inside `data`'s memory (a view of it, not a copy)."""
    import numpy as np

    if not piece.nbytes:
        return False
    start, base = np.frombuffer(piece, np.uint8).ctypes.data, np.frombuffer(data, np.uint8).ctypes.data
    return base <= start and start + piece.nbytes <= base + data.nbytes


class _Version:
    """What the payload cache reads of a store Version."""

    def __init__(self, number: int, tensors: dict[str, torch.Tensor]) -> None:
        from weightserver.protocol.digests import tensor_digests, xxh3_hex

        self.model, self.version = "m", number
        self.data, self.header = version(tensors)
        self.byte_size, self.xxh3 = self.data.nbytes, xxh3_hex(self.data)
        self.tensor_xxh3 = tensor_digests(self.data, self.header)


def test_a_selection_is_built_once_per_version_and_cached_under_its_key():
    cache = PayloadCache()
    record = _Version(1, {"a": torch.arange(12.0).reshape(4, 3), "b": torch.ones(2)})
    selection = tensor_parallel(1, 2, {"a": 1}).resolve(record.header.tensors)
    first, again = cache.get(record, selection=selection), cache.get(record, selection=selection)
    assert first.data is again.data and cache.builds == 1
    assert first.key("m", 1) == ("m", 1, 0, "", "", selection.key) and first.selection.byte_size == first.byte_size
    assert cache.get(record, dtype="BF16", selection=selection).selection == first.selection  # a cast of it
    assert cache.builds == 2


def test_a_selection_ending_in_an_empty_tensor_is_cast():
    """An empty tensor placed last in a selection's file starts where the file ends: reading its
    (empty) bytes through the pieces for a cast raised IndexError, so such a fetch failed INTERNAL."""
    cache = PayloadCache()
    record = _Version(1, {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.uint8), "z": torch.zeros(0)})
    selection = Selection.of(["a", "z"]).resolve(record.header.tensors)
    assert [t.name for t in cache.selected(record, selection).header.tensors] == ["a", "z"]  # "z" last
    payload = cache.get(record, dtype="BF16", selection=selection)
    got = tensor_codec.decode(parse_header(payload.data), memoryview(bytearray(payload.data)))
    assert torch.equal(got["a"], torch.arange(4.0).to(torch.bfloat16)) and got["z"].shape == (0,)
