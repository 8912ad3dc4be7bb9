"""Selections (FetchRequest.select): the part of a version a fetch asks for, which tensors and of
each the whole or one slice along one dimension (a tensor-parallel rank's shard), and their
resolution against a version's tensors, as the proto's Selection documents it.

>>> plan = {"*.q_proj.weight": 0, "*.o_proj.weight": 1}
>>> select = tensor_parallel(1, 2, plan)  # rank 1 of 2; every other tensor whole
>>> [str(rule) for rule in select.rules]
["glob '*.q_proj.weight' dim 0 shard 1/2", "glob '*.o_proj.weight' dim 1 shard 1/2"]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from weightserver.protocol.digests import xxh3_hex
from weightserver.protocol.errors import InvalidRequest, clipped_repr
from weightserver.protocol.limits import MAX_SELECTION_RULES
from weightserver.protocol.safetensors_format import TensorEntry
from weightserver.v1 import weights_pb2 as pb

MATCHES = ("glob", "prefix", "name")
Cut = tuple[int, int, int] | None  # (dim, start, stop) of a tensor; None: the whole tensor
# Tensor-parallel layout of Llama-style models (transformers' names): column-parallel projections
# and the vocabulary along 0, row-parallel ones along 1; norms are left to `rest` (whole).
LLAMA_PLAN: Mapping[str, int] = {
    "*.q_proj.weight": 0,
    "*.k_proj.weight": 0,
    "*.v_proj.weight": 0,
    "*.gate_proj.weight": 0,
    "*.up_proj.weight": 0,
    "*.o_proj.weight": 1,
    "*.down_proj.weight": 1,
    "*.embed_tokens.weight": 0,
    "lm_head.weight": 0,
}


def shard_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of part `rank` of `world` of `size` indices, as torch.chunk cuts (maybe empty)."""
    chunk = -(-size // world)
    return min(rank * chunk, size), min((rank + 1) * chunk, size)


class _Glob:
    """Whether a whole name matches a glob, in time linear in the name's length per '*'-free part:
    one regex with a '.*' per '*' backtracks exponentially (a client's glob stalled the server).
    A class, not a closure, so that a selection pickles (to a collector's worker, a rank's process)."""

    def __init__(self, pattern: str) -> None:
        self.parts = [
            re.compile("".join("." if c == "?" else re.escape(c) for c in p), re.DOTALL) for p in pattern.split("*")
        ]
        self.size = len(pattern.rsplit("*", 1)[-1])  # the last part's length: each character or '?' is one

    def __call__(self, name: str) -> bool:
        if len(self.parts) == 1:
            return self.parts[0].fullmatch(name) is not None
        first, *middle, last = self.parts
        found, end = first.match(name), len(name) - self.size
        if found is None or end < found.end():
            return False
        start = found.end()
        for part in middle:  # each as early as it fits: the earliest leaves the most room to the rest
            found = part.search(name, start, end)
            if found is None:
                return False
            start = found.end()
        return last.fullmatch(name, end) is not None


@dataclass(frozen=True)
class TensorRule:
    """Tensors whose name matches `pattern` (`match`: "glob", "prefix" or "name"): each whole, or
    its slice along `dim`, part `shard` = (rank, world) as torch.chunk cuts, or `span` = (start, stop)."""

    pattern: str
    match: str = "glob"
    dim: int | None = None
    shard: tuple[int, int] | None = None
    span: tuple[int, int] | None = None
    _matcher: Callable[[str], bool] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.match not in MATCHES:
            choices = ", ".join(MATCHES)
            raise InvalidRequest(f"select: rule {clipped_repr(self.pattern)}: match must be one of {choices}")
        if (self.dim is None) != (self.shard is None and self.span is None) or (self.shard and self.span):
            raise InvalidRequest(f"select: rule {self}: give a dim and one of shard or span, or neither (whole)")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise InvalidRequest(f"select: rule {self}: need world >= 1 and 0 <= rank < world")
        if (self.dim is not None and self.dim < 0) or min(self.span or (0,)) < 0:  # (no wire form: uint fields)
            raise InvalidRequest(f"select: rule {self}: dims and indices count from 0; a negative one is not taken")
        object.__setattr__(self, "_matcher", _Glob(self.pattern) if self.match == "glob" else None)

    def __str__(self) -> str:
        part = ""
        if self.shard is not None:
            part = f" dim {self.dim} shard {self.shard[0]}/{self.shard[1]}"
        elif self.span is not None:
            part = f" dim {self.dim} range [{self.span[0]}, {self.span[1]})"
        return f"{self.match} {clipped_repr(self.pattern)}{part}"

    def matches(self, name: str) -> bool:
        if self._matcher is not None:
            return self._matcher(name)
        return name.startswith(self.pattern) if self.match == "prefix" else name == self.pattern

    def cut(self, entry: TensorEntry) -> Cut:
        """This rule's part of `entry` (a slice of a whole dimension: None); InvalidRequest if it does not fit."""
        if self.dim is None:
            return None
        what = f"rule {self} on tensor {clipped_repr(entry.name)} of shape {list(entry.shape)}"
        if self.dim >= len(entry.shape):
            raise InvalidRequest(f"{what}: dim {self.dim} out of range")
        size = entry.shape[self.dim]
        if self.shard is not None:
            start, stop = shard_bounds(size, *self.shard)
        else:
            start, stop = self.span or (0, 0)
            if not 0 <= start <= stop <= size:
                raise InvalidRequest(f"{what}: range [{start}, {stop}) is not within [0, {size}]")
        return None if (start, stop) == (0, size) else (self.dim, start, stop)

    def message(self) -> pb.TensorRule:
        rule = pb.TensorRule(**{self.match: self.pattern})
        if self.shard is not None:
            rule.slice.shard.rank, rule.slice.shard.world = self.shard
        elif self.span is not None:
            rule.slice.range.start, rule.slice.range.stop = self.span
        if self.dim is not None:
            rule.slice.dim = self.dim
        return rule

    @classmethod
    def from_message(cls, rule: pb.TensorRule) -> TensorRule:
        match = rule.WhichOneof("match")
        if match is None:
            raise InvalidRequest("select: a rule sets none of name, prefix or glob")
        pattern = getattr(rule, match)
        if not rule.HasField("slice"):
            return cls(pattern, match)
        part = rule.slice.WhichOneof("part")
        if part is None:
            raise InvalidRequest(f"select: the slice of {match} {clipped_repr(pattern)} sets neither shard nor range")
        shard = (rule.slice.shard.rank, rule.slice.shard.world) if part == "shard" else None
        span = (rule.slice.range.start, rule.slice.range.stop) if part == "range" else None
        return cls(pattern, match, rule.slice.dim, shard, span)


@dataclass(frozen=True)
class Resolved:
    """A selection resolved against one version: each selected tensor's cut, in the version's order;
    `key` names it canonically ("": every tensor whole, the version itself)."""

    cuts: Mapping[str, Cut]
    key: str


@dataclass(frozen=True)
class Selection:
    """The part of a version to fetch: the tensors `rules` match, and with `rest` every other one whole.
    At most MAX_SELECTION_RULES (1,024) rules: more are InvalidRequest, here and on the server."""

    rules: tuple[TensorRule, ...] = ()
    rest: bool = False

    def __post_init__(self) -> None:
        _check_rule_count(len(self.rules))

    @classmethod
    def of(cls, select: Selection | str | Iterable[str]) -> Selection:
        """`select` as a Selection: glob patterns (one, or several) select whole tensors."""
        if isinstance(select, Selection):
            return select
        patterns = [select] if isinstance(select, str) else list(select)
        _check_rule_count(len(patterns))  # before a glob is compiled
        return cls(tuple(TensorRule(pattern) for pattern in patterns))

    def message(self) -> pb.Selection:
        return pb.Selection(rules=[rule.message() for rule in self.rules], rest=self.rest)

    @classmethod
    def from_message(cls, message: pb.Selection) -> Selection:
        _check_rule_count(len(message.rules))  # before a rule is built
        return cls(tuple(TensorRule.from_message(rule) for rule in message.rules), message.rest)

    def resolve(self, tensors: Sequence[TensorEntry]) -> Resolved:
        """Each selected tensor's cut; InvalidRequest naming every rule and tensor at fault."""
        cuts: dict[str, Cut] = {}
        used: set[TensorRule] = set()
        problems: list[str] = []
        for entry in tensors:
            found: dict[Cut, TensorRule] = {}
            for rule in (r for r in self.rules if r.matches(entry.name)):
                used.add(rule)
                try:
                    found.setdefault(rule.cut(entry), rule)
                except InvalidRequest as exc:
                    problems.append(str(exc))
            if len(found) > 1:
                rules = " and ".join(map(str, found.values()))
                problems.append(f"rules {rules} disagree on tensor {clipped_repr(entry.name)}")
            elif found or self.rest:
                cuts[entry.name] = next(iter(found), None)
        problems += [f"rule {rule} matches no tensor" for rule in self.rules if rule not in used]
        if not problems and not cuts:
            problems.append("the selection selects no tensor")
        if problems:
            raise InvalidRequest(f"select: {'; '.join(problems)}")
        whole = len(cuts) == len(tensors) and not any(cuts.values())
        canonical = json.dumps([[name, *(cut or ())] for name, cut in cuts.items()], separators=(",", ":"))
        return Resolved(cuts, "" if whole else xxh3_hex(canonical.encode()))


def _check_rule_count(count: int) -> None:
    if count > MAX_SELECTION_RULES:
        raise InvalidRequest(
            f"select: {count} rules, over the limit of {MAX_SELECTION_RULES} rules a selection may have "
            "(match many tensors with one glob or prefix rule, or with `rest`)"
        )


def tensor_parallel(rank: int, world: int, plan: Mapping[str, int | None], *, rest: bool = True) -> Selection:
    """Rank `rank` of `world`'s shard: each glob pattern of `plan` split along its dimension (None:
    whole), and with `rest` every tensor the plan does not name whole (norms, biases)."""
    rules = (TensorRule(p) if dim is None else TensorRule(p, dim=dim, shard=(rank, world)) for p, dim in plan.items())
    return Selection(tuple(rules), rest)
