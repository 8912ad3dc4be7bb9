"""`trace_ddpg_delta` and `trace_lm_delta` (issue 31): what element deltas send for real training
updates (bench/traces.py), through a real server and client.

A server in this process (`WeightServer`, so its payload builds can be timed); the trainer side
publishes each version of the trace (`WeightClient.publish`), and a collector (a second client)
fetches it with `base=` the previous version's FetchResult, so changed tensors come as their
changed elements where that is smaller (`FetchRequest.element_deltas`). Per version:

- bytes: `stats.wire_bytes` of that fetch, against a full fetch's (ratio full / delta); the old
  tensor-level delta (`base=` the previous version's number: the tensors whose digest changed,
  whole) fetched too; and XOR against the previous version + zlib (level 1), per tensor, computed
  here on the same tensors (tensor bytes only, no header), as an alternative form;
- the fraction of elements whose bytes changed (compared here, per element);
- the server's cost of building the payload: `PayloadCache.get` (derive: the sampled worth check,
  `deltas.encode` per changed tensor, the file's xxh3), wrapped on the server's own cache and timed
  on its worker thread (`time.thread_time`: CPU; wall time in the JSON);
- the collector's rebuild: CPU time in `deltas.Rebuild` (wrapped: the copy of the base, then as the
  payload arrives its hashing and the changed elements written; the bytes of whole tensors land in
  place from the socket, uncounted) plus the xxh3 of the rebuilt file, timed again on the same bytes
  (the client's own check); against XOR + zlib's decode (decompress, XOR onto the base, xxh3 of the
  tensors);
- every fetched version compared byte for byte with the published tensors.

`--repeats` does not apply: the samples are the trace's versions (`--trace-versions`).
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from bench.common import MB, Row, log

if TYPE_CHECKING:  # standard library + bench.common at module level: bench/run.py imports this module
    import numpy as np
    import torch

LM_TARGET = 20.0  # x fewer bytes per version (issue 31)
ZLIB_LEVEL = 1
TRACES = ("trace_ddpg", "trace_lm")
ROWS = tuple(f"{trace}_delta" for trace in TRACES)
SUFFIXES = ("delta", "tensor_delta", "xor_zlib", "changed", "encode", "decode")
NAMES = tuple(f"{trace}_{suffix}" for trace in TRACES for suffix in SUFFIXES)
ALIASES = {f"{trace}_{suffix}": f"{trace}_delta" for trace in TRACES for suffix in SUFFIXES[1:]}


def _words(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of the same size (raw bytes, compared as such)."""
    import torch

    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().view(f"<u{flat.element_size()}")


def changed_elements(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Elements whose bytes differ, elements in all, tensors with any change, and the bytes of the
    changed tensors in each element delta form alone (`deltas.sizes`; unchanged tensors: 0 bytes)."""
    import numpy as np

    from weightserver.protocol import deltas

    out: dict[str, Any] = {"changed_elements": 0, "elements": 0, "changed_tensors": 0}
    out |= {f"{form}_only_bytes": 0 for form in deltas.FORMS}
    for name, tensor in new.items():
        count = int(np.count_nonzero(_words(old[name]) != _words(tensor)))
        out["changed_elements"] += count
        out["elements"] += tensor.numel()
        out["changed_tensors"] += count > 0
        if count:
            for form, size in deltas.sizes(tensor.numel(), count, tensor.element_size()).items():
                if form:
                    out[f"{form}_only_bytes"] += size
    return out


def xor_zlib(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """XOR each tensor with its previous version, zlib it (level ZLIB_LEVEL); then decode it back
    (decompress, XOR onto the base, xxh3 of the result) and check it. Bytes and seconds (CPU)."""
    import numpy as np

    from weightserver.protocol.digests import xxh3_hex

    encoded, started = {}, time.thread_time()
    for name, tensor in new.items():
        encoded[name] = zlib.compress(np.bitwise_xor(_words(old[name]), _words(tensor)), ZLIB_LEVEL)
    encode_s, started = time.thread_time() - started, time.thread_time()
    rebuilt = {}
    for name, data in encoded.items():
        base = _words(old[name])
        rebuilt[name] = np.bitwise_xor(base, np.frombuffer(zlib.decompress(data), dtype=base.dtype))
        xxh3_hex(rebuilt[name])
    decode_s = time.thread_time() - started
    if any(not np.array_equal(rebuilt[name], _words(tensor)) for name, tensor in new.items()):
        raise AssertionError("XOR + zlib did not rebuild the version")
    return {"bytes": sum(len(d) for d in encoded.values()), "encode_s": encode_s, "decode_s": decode_s}


def _bit_exact(result: Any, weights: dict[str, torch.Tensor]) -> bool:
    import numpy as np

    got = result.state_dict()
    return sorted(got) == sorted(weights) and all(
        got[n].dtype == t.dtype and got[n].shape == t.shape and np.array_equal(_words(got[n]), _words(t))
        for n, t in weights.items()
    )


class _Timed:
    """Wraps the server's `PayloadCache.get` and the client's `deltas.Rebuild` while a trace runs."""

    def __init__(self, server: Any) -> None:
        from weightserver.protocol.deltas import Rebuild

        self.builds: list[dict[str, Any]] = []
        self._rebuilding: list[tuple[Rebuild, list[float]]] = []  # each rebuild, and its CPU seconds
        self._cache, self._class = server.servicer.payloads, Rebuild
        self._get, self._on, self._advance = self._cache.get, Rebuild.on, Rebuild.advance
        self._descriptor = Rebuild.__dict__["on"]  # (the classmethod itself, put back on exit)

    def __enter__(self) -> _Timed:
        timed = self

        def advance(rebuild, n: int) -> None:
            started = time.thread_time()
            timed._advance(rebuild, n)
            next(cpu for r, cpu in timed._rebuilding if r is rebuild)[0] += time.thread_time() - started

        self._cache.get, self._class.on = self._timed_get, staticmethod(self._timed_on)
        self._class.advance = advance
        return self

    def __exit__(self, *exc: object) -> None:
        self._cache.get, self._class.on, self._class.advance = self._get, self._descriptor, self._advance

    @property
    def rebuilds(self) -> list[dict[str, Any]]:
        """Per rebuild since `clear`: its CPU seconds, the xxh3 of the file it rebuilt, timed again."""
        from weightserver.protocol.digests import xxh3_hex

        out = []
        for rebuild, (cpu_s,) in self._rebuilding:
            started = time.thread_time()
            xxh3_hex(rebuild.rebuilt)  # as the client checks it next
            whole = [name for name in rebuild.changed if name not in rebuild.forms]
            out.append({"apply_s": cpu_s, "xxh3_s": time.thread_time() - started, "forms": rebuild.forms})
            out[-1]["whole"] = whole
        return out

    def clear(self) -> None:
        self.builds.clear()
        self._rebuilding.clear()

    def _timed_get(self, target, base=None, dtype: str = "", forms: tuple[str, ...] = (), **more):
        wall, cpu = time.perf_counter(), time.thread_time()
        payload = self._get(target, base, dtype, forms, **more)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        self.builds.append({"base": base.version if base is not None else 0, "forms": tuple(forms), "cpu_s": cpu})
        self.builds[-1].update(wall_s=wall, payload_bytes=payload.byte_size, element_forms=list(payload.forms))
        return payload

    def _timed_on(self, *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        rebuild = self._on(*args, **kwargs)
        if rebuild is not None:
            self._rebuilding.append((rebuild, [time.thread_time() - started]))
        return rebuild


def run_trace(trace: Iterable[dict[str, torch.Tensor]], model: str, transport: str = "bulk") -> dict[str, Any]:
    """Publish every state dict of `trace` to a fresh in-process server and fetch each as a delta
    against the previous FetchResult; per version figures (see the module docstring)."""
    from weightclient import WeightClient
    from weightserver import ServerConfig, WeightServer

    versions = iter(trace)
    first = next(versions)
    server = WeightServer(ServerConfig(host="127.0.0.1", port=0, keep=2)).start()  # the base and the version
    try:
        with (
            WeightClient(server.address) as trainer,
            WeightClient(server.address) as collector,
            _Timed(server) as timed,
        ):
            version = trainer.publish(first, model=model)
            held = collector.fetch(model, version=version, transport=transport)
            full_wire, exact = held.stats.wire_bytes, _bit_exact(held, first)
            tensor_bytes = sum(t.numel() * t.element_size() for t in first.values())
            out: dict[str, Any] = {"full_wire_bytes": full_wire, "tensor_bytes": tensor_bytes, "versions": []}
            out["tensors"], out["transport"] = len(first), held.stats.transport
            previous, previous_version, produced = first, version, time.perf_counter()
            for weights in versions:
                trained_s = time.perf_counter() - produced
                version = trainer.publish(weights, model=model)
                timed.clear()
                started = time.perf_counter()
                result = collector.fetch(model, version=version, base=held, transport=transport)
                fetch_s = time.perf_counter() - started
                builds, rebuilds = list(timed.builds), list(timed.rebuilds)
                exact &= _bit_exact(result, weights) and not (rebuilds and not result.base_version)
                old = collector.fetch(model, version=version, base=previous_version, transport=transport)
                counts = changed_elements(previous, weights)
                row = {
                    "version": version,
                    "delta_wire_bytes": result.stats.wire_bytes,
                    "rebuilt_from_delta": bool(result.base_version),
                    "tensor_delta_wire_bytes": old.stats.wire_bytes,
                    **counts,
                    "encode_cpu_s": sum(b["cpu_s"] for b in builds),
                    "encode_wall_s": sum(b["wall_s"] for b in builds),
                    "builds": builds,
                    "decode_s": sum(r["apply_s"] + r["xxh3_s"] for r in rebuilds) if rebuilds else None,
                    "rebuilds": rebuilds,
                    "fetch_s": fetch_s,
                    "xor_zlib": xor_zlib(previous, weights),
                    "trained_s": trained_s,
                }
                out["versions"].append(row)
                forms = rebuilds[0]["forms"] if rebuilds else {}
                decode = "-" if row["decode_s"] is None else f"{1e3 * row['decode_s']:.1f} ms"
                log(
                    f"{model} v{version}: {_mb(row['delta_wire_bytes'])} of {_mb(full_wire)}, "
                    f"{100 * counts['changed_elements'] / counts['elements']:.2f}% changed, forms {_count(forms)}, "
                    f"encode {1e3 * row['encode_wall_s']:.1f} ms, decode {decode}"
                )
                del old
                held, previous, previous_version, produced = result, weights, version, time.perf_counter()
            out["bit_exact"] = bool(exact)
            return out
    finally:
        server.stop(grace=0)


def _mb(nbytes: float) -> str:
    return f"{nbytes / MB:.3g} MB" if nbytes >= MB else f"{nbytes / 1e3:.3g} kB"


def _count(forms: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for form in forms.values():
        counts[form] = counts.get(form, 0) + 1
    return ", ".join(f"{form} {n}" for form, n in sorted(counts.items())) or "none"


def trace_rows(prefix: str, figures: dict[str, Any], target: float | None, what: str) -> list[Row]:
    """The six rows of one trace's figures (`run_trace`)."""
    per = figures["versions"]
    full, tensor_bytes = figures["full_wire_bytes"], figures["tensor_bytes"]
    median = statistics.median
    delta = Row(f"{prefix}_delta", None, "x", [full / v["delta_wire_bytes"] for v in per])
    delta.extra = {**{k: v for k, v in figures.items() if k != "versions"}, "what": what, "versions": per}
    forms: dict[str, int] = {}
    for v in per:
        for r in v["rebuilds"]:
            for form in r["forms"].values():
                forms[form] = forms.get(form, 0) + 1
            forms["whole"] = forms.get("whole", 0) + len(r["whole"])
    encoded = ", ".join(f"{k} {n}" for k, n in sorted(forms.items())) or "none (every version sent whole)"
    delta.note = (
        f"{what}; {len(per)} deltas; median {_mb(median(v['delta_wire_bytes'] for v in per))} per version "
        f"against a full fetch of {_mb(full)} "
        f"(full / delta wire bytes); changed tensors sent as {encoded} (tensor-versions)"
    )
    alone = {form: median(v[f"{form}_only_bytes"] for v in per) for form in ("sparse", "bitmap")}
    delta.note += "; changed tensors in one form alone: " + ", ".join(f"{f} {_mb(b)}" for f, b in alone.items())
    if not figures["bit_exact"]:
        delta.note += "; WRONG WEIGHTS: a fetched version differs from the published one"
    if target is not None:
        delta.judge(median(delta.samples), ">=", target)
        delta.passed = delta.passed and figures["bit_exact"]
    else:
        delta.ratio, delta.target = median(delta.samples), "none (reported)"
    tensor = Row(f"{prefix}_tensor_delta", None, "x", [full / v["tensor_delta_wire_bytes"] for v in per])
    tensor.note = "the tensor-level delta (base= the previous version's number): changed tensors sent whole"
    xor = Row(f"{prefix}_xor_zlib", None, "x", [tensor_bytes / v["xor_zlib"]["bytes"] for v in per])
    xor.note = f"tensor bytes / XOR with the previous version + zlib level {ZLIB_LEVEL} (tensor bytes only)"
    changed = Row(f"{prefix}_changed", None, "%", [100 * v["changed_elements"] / v["elements"] for v in per])
    changed.note = f"elements whose bytes changed; tensors changed: {median(v['changed_tensors'] for v in per):g} "
    changed.note += f"of {figures['tensors']} (median)"
    from weightserver.storage import payloads

    encode = Row(f"{prefix}_encode", None, "ms", [1e3 * v["encode_wall_s"] for v in per])
    encode.note = (
        "server time building the delta payload (PayloadCache.get, wall: its tensors are encoded on "
        f"{payloads.ENCODE_THREADS} threads); baseline: XOR + zlib encode, one thread"
    )
    _against(encode, "xor+zlib", [1e3 * v["xor_zlib"]["encode_s"] for v in per])
    decodes = [1e3 * v["decode_s"] for v in per if v["decode_s"] is not None]
    decode = Row(f"{prefix}_decode", None, "ms", decodes)
    decode.note = "collector CPU rebuilding as the delta arrives (base copied, elements written) + xxh3 of the file"
    if not decodes:
        decode.status, decode.note = "n/a", "no version came as a delta (whole: nothing to rebuild)"
    else:
        _against(decode, "xor+zlib", [1e3 * v["xor_zlib"]["decode_s"] for v in per])
    for row in (tensor, xor, changed, encode, decode):
        row.target = row.target or "none (reported)"
    return [delta, tensor, xor, changed, encode, decode]


def _against(row: Row, name: str, samples: list[float]) -> None:
    row.baseline, row.baseline_value = name, statistics.median(samples)
    if row.samples and row.baseline_value:
        row.ratio = statistics.median(row.samples) / row.baseline_value
    row.extra["baseline_samples"] = samples


def trace_ddpg_delta(versions: int, transport: str = "bulk") -> list[Row]:
    """The demo's DDPG actor, fp32, a publish every 50 Adam steps; reported as it is."""
    from bench.traces import ddpg_trace

    figures = run_trace(ddpg_trace(versions), "trace-ddpg", transport)
    return trace_rows("trace_ddpg", figures, None, "DDPG actor fp32, Adam lr 1e-3, every 50 steps")


def trace_lm_delta(versions: int, transport: str = "bulk") -> list[Row]:
    """A 134M-parameter Llama, bf16 cast of fp32 AdamW (lr 1e-6) weights every step; >= 20x fewer bytes."""
    from bench.traces import lm_trace

    figures = run_trace(lm_trace(versions), "trace-lm", transport)
    return trace_rows("trace_lm", figures, LM_TARGET, "Llama 134M bf16 cast, AdamW lr 1e-6, every step")


ROW_FUNCTIONS: dict[str, Callable[[int, str], list[Row]]] = {
    "trace_ddpg_delta": trace_ddpg_delta,
    "trace_lm_delta": trace_lm_delta,
}
