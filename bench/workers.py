"""Entry points of the benchmark's child processes (started with multiprocessing "spawn").

Only the standard library is imported at module level, so children that need no torch (the
raw TCP sender, byte-level fetchers, the watcher) start in a fraction of a second; torch and
the clients are imported inside the functions that use them.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from typing import Any

from bench.common import PeakRss, hwm_bytes, rss_bytes


def tcp_sender(port: int, nbytes: int, rounds: int) -> None:
    """Raw TCP baseline, sending side: for each 1-byte 'go' from the receiver,
    `sendall(memoryview)` of `nbytes` from a buffer whose pages are already resident."""
    buffer = bytearray(b"\x5a") * nbytes  # filled, so every page is touched
    view = memoryview(buffer)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            if not sock.recv(1):
                return
            sock.sendall(view)


def gloo_rank(rank: int, init_file: str, nbytes: int, commands: Any, results: Any) -> None:
    """gloo baseline: one of two ranks; rank 0 broadcasts `nbytes` of float32 to rank 1.

    For every command (a round number; None ends) both ranks meet at a barrier, then rank 0
    broadcasts a tensor filled with that number. Rank 1 (the receiver) reports each broadcast's
    duration in seconds and whether the number arrived at both ends of the tensor. Driven a
    round at a time, so a row can interleave its own measurements with the baseline's.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tensor = torch.zeros(nbytes // 4)
        while (value := commands.get()) is not None:
            if rank == 0:
                tensor.fill_(float(value))
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(tensor, src=0)
            elapsed = time.perf_counter() - start
            if rank == 1:
                results.put((elapsed, bool(tensor[0] == value and tensor[-1] == value)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fetch_worker(
    index: int,
    address: str,
    use_torch: bool,
    warm_model: str | None,
    fetch_kwargs: dict[str, Any],
    commands: Any,
    results: Any,
    barrier: Any,
) -> None:
    """A long-lived fetching collector for the fan-out and server-memory rows.

    With `use_torch` it fetches through `WeightClient.fetch` (tensors viewing the received
    buffer, as a collector would get them); otherwise through the byte-level
    `WeightServiceClient.fetch_bytes` (no torch import, for the 16-fetcher memory row).
    `fetch_kwargs` go to every fetch (e.g. transport=), updated by a command's own. Commands:
    ("fetch", model, version, wait_for_barrier, kwargs) or None to exit. Each fetch reports (index,
    start time_ns, end time_ns, bytes received, transport used); times come from time.time_ns(), comparable across
    processes.
    """
    if use_torch:
        from weightclient import WeightClient

        client: Any = WeightClient(address)
        fetch = client.fetch
    else:
        from weightclient.core.service_client import WeightServiceClient

        client = WeightServiceClient(address)
        fetch = client.fetch_bytes
    if warm_model:
        client.latest(warm_model)  # connect the channel before anything is timed
    results.put(("ready", index))
    while (command := commands.get()) is not None:
        _, model, version, synchronized, kwargs = command
        if synchronized:
            barrier.wait()
        start = time.time_ns()
        fetched = fetch(model, version=version, **{**fetch_kwargs, **kwargs})
        end = time.time_ns()
        received = len(fetched.data)
        transport = getattr(getattr(fetched, "stats", None), "transport", None) or "stream"
        del fetched
        results.put((index, start, end, received, transport))
    client.close()


def watcher(address: str, model: str, since: int, count: int, results: Any, timeout: float) -> None:
    """Watch `model` from `since`, stamping each event with time.time_ns() on arrival.

    Puts ("subscribed", version) after the first event (the version published before the
    watcher started, replayed from `since`), then a list of (version, arrival time_ns) once
    `count` further events arrived.
    """
    from weightclient.core.service_client import WeightServiceClient

    arrivals: list[tuple[int, int]] = []
    with WeightServiceClient(address) as client:
        for event in client.watch(model, since=since, timeout=timeout):
            arrivals.append((event.version, time.time_ns()))
            if len(arrivals) == 1:
                results.put(("subscribed", event.version))
            elif len(arrivals) > count:
                break
    results.put(arrivals[1:])


def memory_probe(
    address: str,
    model: str,
    version: int,
    shapes: list[int],
    expected: float,
    fetch_kwargs: dict[str, Any],
    results: Any,
) -> None:
    """Peak RSS increase of a fresh collector process during one fetch into a live policy.

    The live policy is allocated (and its pages touched) and the channel connected before the
    baseline reading. A thread samples VmRSS every 5 ms during fetch + `p.copy_`; VmHWM is
    read too and used when it rose during the fetch (it cannot miss a short peak).
    """
    import torch

    from bench.models import copy_into, policy_from_shapes
    from weightclient import WeightClient

    torch.set_num_threads(1)
    policy = policy_from_shapes(shapes, fill=-1.0)
    client = WeightClient(address)
    client.describe(model, version)
    gc.collect()
    before_rss, before_hwm = rss_bytes(), hwm_bytes()
    with PeakRss(os.getpid(), interval=0.005) as sampler:
        result = client.fetch(model, version=version, **fetch_kwargs)
        copy_into(policy, result.state_dict())
        transport = getattr(getattr(result, "stats", None), "transport", None) or "stream"
        del result
        gc.collect()
    after_rss, after_hwm = rss_bytes(), hwm_bytes()
    peak = max(sampler.peak, after_hwm if after_hwm > before_hwm else 0)
    results.put(
        {
            "before_rss": before_rss,
            "peak_rss": peak,
            "after_rss": after_rss,
            "sampled_peak": sampler.peak,
            "samples": sampler.count,
            "hwm_before": before_hwm,
            "hwm_after": after_hwm,
            "increase": peak - before_rss,
            "verified": bool(policy.w0[0].item() == expected),
            "transport": transport,
        }
    )
    client.close()


def stream_fetch_load(
    address: str, model: str, fetchers: int, connections: int, stop: Any, results: Any, nice: int = 0
) -> None:
    """`fetchers` collectors fetching the latest `model` over gRPC streams back to back, from
    one asyncio loop over `connections` channels (raw stubs: 200 Python clients in threads
    would measure the GIL of this process, not the server), in a process at `nice`.

    Puts ("running", 0) once every fetcher has its first response, then, after `stop` is set
    and the fetches in flight ended, a list of (start time_ns, end time_ns, bytes, error or
    "") per fetch. A fetch whose bytes do not match the header's size and xxh3 is an error.
    """
    import asyncio

    os.nice(nice)
    asyncio.run(_stream_fetch_load(address, model, fetchers, connections, stop, results))


async def _stream_fetch_load(address: str, model: str, fetchers: int, connections: int, stop: Any, results: Any):
    import asyncio

    import grpc
    import xxhash

    from weightserver.protocol import framing
    from weightserver.v1 import weights_pb2 as pb

    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 8 << 20)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    calls = [
        channel.unary_stream(
            "/weightserver.v1.WeightService/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=framing.deserialize_fetch_response,
        )
        for channel in channels
    ]
    records: list[tuple[int, int, int, str]] = []
    started = asyncio.Event()
    waiting = [fetchers]

    def answered() -> None:
        waiting[0] -= 1
        if not waiting[0]:
            started.set()

    async def fetch_once(fetch: Any, first: bool) -> None:
        start, received, error = time.time_ns(), 0, ""
        digest, info = xxhash.xxh3_128(), None
        try:
            async for message in fetch(pb.FetchRequest(model=model), timeout=600):
                if isinstance(message, memoryview):
                    digest.update(message)
                    received += message.nbytes
                elif message.HasField("header"):
                    info = message.header
                    if first:
                        first = False
                        answered()
            if info is None or received != info.byte_size or digest.hexdigest() != info.xxh3:
                error = f"wrong bytes: {received} of {info.byte_size if info else '?'}"
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        if first:
            answered()  # an error is an answer too: the row reports it
        records.append((start, time.time_ns(), received, error))

    async def fetcher(index: int) -> None:
        first = True
        while not stop.is_set():
            await fetch_once(calls[index % connections], first)
            first = False

    tasks = [asyncio.ensure_future(fetcher(i)) for i in range(fetchers)]
    await started.wait()
    results.put(("running", 0))
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    results.put(records)


def _lm_policy(config: str) -> Any:
    """The collector's policy for a trace of `bench.traces.lm_trace`: the same Llama, in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.traces import LM_CONFIGS

    return LlamaForCausalLM(LlamaConfig(**LM_CONFIGS[config])).to(torch.bfloat16)


def freshness_collector(
    index: int,
    address: str,
    model: str,
    shapes: list[int] | dict[str, str],
    transport: str,
    stop: Any,
    results: Any,
    incoming: bool = True,
    updater_options: dict[str, Any] | None = None,
) -> None:
    """A collector for the freshness rows: a live policy kept current by
    `GrpcLocalWeightUpdater(watch=True, transport=transport, incoming=incoming,
    **updater_options)`.

    It sleeps until a version newer than the applied one is announced (a Watch stream of its
    own, the wake-up), then calls the updater until the policy holds it: the updater fetches
    only once its own follower has the announcement too, so it may take a few calls, 0.2 ms
    apart. A collector polling its updater every millisecond instead cost 3% of a core each
    while idle, which 8 of them take from the server and the publisher on a 2-core machine.

    Puts ("ready", index) once its policy holds a version and its updater follows the Watch
    stream, then for every version it applies (index, version, time.monotonic() right after
    the updater returned with it in the policy, transport used, [(p[0], p[-1]) of each
    parameter], whether it was received before its commit (cut-through), whether it was applied
    zero-copy). CLOCK_MONOTONIC is
    one clock for every process on a Linux host, so the publisher compares these stamps with
    its own. Runs until `stop` is set.
    """
    import torch

    from bench.models import policy_from_shapes
    from weightclient import WeightClient
    from weightclient.core.service_client import WeightServiceClient
    from weightclient.torchrl.grpc_updaters import GrpcLocalWeightUpdater

    torch.set_num_threads(1)
    policy = policy_from_shapes(shapes, fill=-1.0) if isinstance(shapes, list) else _lm_policy(shapes["lm_config"])
    client, wakeups = WeightClient(address), WeightServiceClient(address)
    options = {"incoming": incoming} if incoming is not True else {}  # a client without it: default
    options.update(updater_options or {})
    updater = GrpcLocalWeightUpdater(client, model=model, policy=policy, watch=True, transport=transport, **options)

    def update() -> None:
        before = updater.version
        updater()
        if updater.version != before:
            at = time.monotonic()
            used = getattr(updater.last_fetch, "transport", None) or "stream"
            with torch.no_grad():
                ends = [(float(p.view(-1)[0]), float(p.view(-1)[-1])) for p in policy.parameters()]
            early = bool(getattr(updater.last_fetch, "incoming", False))
            results.put((index, updater.version, at, used, ends, early, bool(getattr(updater, "zero_copy", False))))

    try:
        _woken(index, wakeups, model, updater, update, stop, results)
    finally:
        wakeups.close()
        client.close()


def _woken(index: int, wakeups: Any, model: str, updater: Any, update: Any, stop: Any, results: Any) -> None:
    """Until `stop`: for each version `wakeups` announces, `update()` until `updater` holds it
    (0.2 ms apart: its own follower may hear of it a little later); ("ready", index) once the
    updater holds a version and follows the Watch stream."""
    from weightserver.protocol.errors import DeadlineExceeded

    ready = False
    while not stop.is_set():
        try:
            # renewed every second so that `stop` is seen; replays anything newer than applied
            for event in wakeups.watch(model, since=updater.version or 0, timeout=1.0):
                while (updater.version or 0) < event.version and not stop.is_set():
                    update()
                    if (updater.version or 0) < event.version:
                        time.sleep(0.0002)
                while not updater.following and not stop.is_set():  # the first time: start following
                    update()
                    time.sleep(0.001)
                if not ready and updater.following:
                    results.put(("ready", index))
                    ready = True
                if stop.is_set():
                    break
        except DeadlineExceeded:
            pass


def freshness_multi_collector(
    index: int, address: str, model: str, nbytes: int, transport: str, stop: Any, results: Any, *_: Any
) -> None:
    """The collector of the `freshness_local_multi` row: torchrl's MultiSyncCollector with 2 worker
    processes on PendulumEnv (the policy of bench/torchrl_sync.py, ~`nbytes` of parameters),
    following `model` through `GrpcWeightSyncScheme(address, model=model, watch=True,
    transport=transport)`, defaults otherwise. The workers' parameters are torchrl's shared
    buffers, so each version is copied into them once, then both workers are told and
    acknowledge (the scheme is synchronous).

    Woken by a Watch stream of its own, as `freshness_collector` is; reports as it does, with
    time.monotonic() once `update_policy_weights_()` returned holding the version (both workers
    acknowledged) and the ends of each shared parameter.
    """
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from torchrl.collectors import MultiSyncCollector

    from bench.torchrl_sync import make_env, make_policy
    from weightclient.core.service_client import WeightServiceClient
    from weightclient.torchrl.scheme import GrpcWeightSyncScheme

    torch.set_num_threads(1)
    scheme = GrpcWeightSyncScheme(address, model=model, watch=True, transport=transport)
    collector = MultiSyncCollector(
        [make_env, make_env],
        make_policy(nbytes),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        auto_register_policy_transforms=False,
    )
    wakeups = WeightServiceClient(address)
    puller = scheme.puller
    assert puller is not None

    def update() -> None:
        before = puller.version
        collector.update_policy_weights_()
        if puller.version != before:
            at = time.monotonic()
            with torch.no_grad():
                shared = scheme.weights.flatten_keys(".")
                ends = [(float(p.view(-1)[0]), float(p.view(-1)[-1])) for p in shared.values()]
            stats = puller.last_fetch
            used = getattr(stats, "transport", None) or "stream"
            results.put((index, puller.version, at, used, ends, bool(stats and stats.incoming), puller.zero_copy))

    try:
        _woken(index, wakeups, model, puller, update, stop, results)
    finally:
        wakeups.close()
        collector.shutdown()


def tree_collectors(first: int, addresses: list[str], model: str, transport: str, stop: Any, results: Any) -> None:
    """Byte-level collectors for the `fanout_tree` row: one thread per address in `addresses`
    (collector `first + i` follows `addresses[i]`), no torch import, so 32 of them fit a small
    machine in a few processes.

    Each thread is what a deployed collector does with a byte-level client: one
    `WeightServiceClient` (client id `collector-N`), the model's current version fetched into a
    receive buffer of its own, then a Watch of committed versions; for every version
    announced, `fetch_bytes(version=V, transport=transport, into=buffer)`, which checks the
    bytes against the announced xxh3 (on a relay: the primary's digests). Cut-through stops
    at the relay: a collector fetches a version once its commit is announced.

    Puts ("ready", index) after the first fetch, then (index, version, time.monotonic() right
    after the fetch returned, transport that carried it, xxh3 of the version) per version, or
    ("error", index, text) if a thread fails. Runs until `stop` is set.
    """
    import threading

    from weightclient.core.service_client import WeightServiceClient
    from weightserver.protocol.errors import DeadlineExceeded
    from weightserver.protocol.version_info import VersionEvent

    def follow(index: int, address: str) -> None:
        try:
            with WeightServiceClient(address, client_id=f"collector-{index}") as client:
                latest = client.latest(model)
                buffer = memoryview(bytearray(latest.byte_size))
                held = client.fetch_bytes(model, version=latest.version, transport=transport, into=buffer).info.version
                results.put(("ready", index))
                while not stop.is_set():
                    try:
                        # renewed every second so that `stop` is seen; replays anything newer than held
                        for event in client.watch(model, since=held, timeout=1.0):
                            if not isinstance(event, VersionEvent) or event.version <= held:
                                continue
                            if event.info.byte_size > buffer.nbytes:
                                buffer = memoryview(bytearray(event.info.byte_size))
                            fetched = client.fetch_bytes(model, version=event.version, transport=transport, into=buffer)
                            at = time.monotonic()
                            used = fetched.stats.transport if fetched.stats else "stream"
                            held = fetched.info.version
                            results.put((index, held, at, used, fetched.info.xxh3))
                            if stop.is_set():
                                break
                    except DeadlineExceeded:
                        pass
        except Exception as exc:  # reported: the row fails rather than waiting for a dead thread
            results.put(("error", index, f"{type(exc).__name__}: {exc}"))

    threads = [
        threading.Thread(target=follow, args=(first + i, address), name=f"collector-{first + i}", daemon=True)
        for i, address in enumerate(addresses)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
