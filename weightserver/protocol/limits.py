"""Sizes and limits both sides of the wire agree on."""

from __future__ import annotations

import contextlib
import operator

from weightserver.protocol.errors import InvalidRequest, clipped_repr

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_PORT = 50051
DEFAULT_CHUNK_BYTES = 1 * MiB
MIN_CHUNK_BYTES = 64 * KiB
MAX_CHUNK_BYTES = 3 * MiB  # stays well below gRPC's 4 MiB default message limit
MAX_MESSAGE_BYTES = 8 * MiB  # a chunk plus framing, with room to spare
# A channel to a server: messages as large as the server's; a reconnect within a second of a restart
# (gRPC's default backoff grows to two minutes: a collector on old weights that long); subchannels of its
# own (from the shared pool, a new client took over an older one's connection in backoff and was refused).
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CLIENT_MESSAGE_BYTES = 4 * MiB  # what a gRPC client receives by default
# A version's description: a quarter of a client message, so replies carrying several fit too.
MAX_DESCRIPTION_BYTES = 1 * MiB
# The descriptions of one reply; a publish that would make a reply larger is refused.
MAX_DESCRIPTIONS_PER_REPLY = CLIENT_MESSAGE_BYTES - 64 * KiB
# A published header's limits, agreeing with MAX_DESCRIPTION_BYTES: a description takes >= 43
# bytes per tensor; the header's JSON at most about twice that, plus the file's __metadata__.
PUBLISH_MAX_TENSORS = MAX_DESCRIPTION_BYTES // 43
PUBLISH_MAX_HEADER_BYTES = 4 * MAX_DESCRIPTION_BYTES
# The rules of one selection (FetchRequest.select): the server matches each against every tensor name on
# its event loop, and hundreds of thousands stalled it; a tensor-parallel plan has a handful (LLAMA_PLAN: 9),
# globs or prefixes cover the rest. Over it: INVALID_ARGUMENT before anything is matched, and client-side.
MAX_SELECTION_RULES = 1024
# A version number's field on the wire (uint64). The server hands out at most 2^63-1 and says so;
# a number no field holds is refused before any call, naming its argument (not protobuf's ValueError).
MAX_VERSION_FIELD = 2**64 - 1


def version_number(value: object, name: str, *, least: int = 0, meaning: str = "") -> int:
    """`value` if a version field holds it (a whole number from `least` to 2**64-1); else
    InvalidRequest naming `name`, the range, and `meaning` (what 0 stands for, say "0: the latest")."""
    with contextlib.suppress(TypeError):  # (not a whole number)
        number = operator.index(value)  # type: ignore[call-overload]
        if not isinstance(value, bool) and least <= number <= MAX_VERSION_FIELD:
            return number
    said = f" ({meaning})" if meaning else ""
    raise InvalidRequest(f"{name} must be a whole number from {least} to 2**64-1{said}, got {clipped_repr(value)}")
