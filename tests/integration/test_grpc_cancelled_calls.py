"""gRPC (1.85) reports a call cancelled before its handler ran twice: an ERROR log record (the
server drops it: tests/unit/test_grpc_shutdown_log.py) and the CancelledError's traceback printed
to stderr (`_schedule_rpc_coro`: `traceback.print_exc()`), which reached a server's log in CI as it
stopped. The server keeps that print off stderr too, and only that one."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc._cython import cygrpc

import weightserver.server  # noqa: F401  (quiets gRPC's print of a cancelled call)


# The handler's task never starts, so neither does the coroutine it was given: Python says so.
@pytest.mark.filterwarnings("ignore:coroutine '_handle_rpc' was never awaited:RuntimeWarning")
def test_a_call_cancelled_before_its_handler_ran_prints_no_traceback(capfd):
    """Caused for real: the handler's task is cancelled before its first step, as when the call
    is cancelled before it runs (a client that goes, a server that stops)."""

    async def never(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise AssertionError("the handler ran")

    def cancel_handlers(loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if getattr(coro, "__name__", "") == "_handle_exceptions":  # gRPC's task running the handler
            task.cancel()
        return task

    async def main() -> grpc.StatusCode | None:
        asyncio.get_running_loop().set_task_factory(cancel_handlers)
        server = grpc.aio.server()
        methods = {"Never": grpc.unary_unary_rpc_method_handler(never)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        code = None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await channel.unary_unary("/t.T/Never")(b"", timeout=0.5)
                except grpc.aio.AioRpcError as error:
                    code = error.code()
            await asyncio.sleep(0.2)  # gRPC's task for the call sees its handler's end
        finally:
            await server.stop(None)
        return code

    assert asyncio.run(main()) is grpc.StatusCode.DEADLINE_EXCEEDED
    printed = capfd.readouterr().err
    assert "Traceback" not in printed, printed


def test_other_tracebacks_grpc_prints_still_reach_stderr(capfd):
    try:
        raise ValueError("a real fault")
    except ValueError:
        cygrpc.traceback.print_exc()
    assert "ValueError: a real fault" in capfd.readouterr().err
