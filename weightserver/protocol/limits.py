"""Sizes and limits both sides of the wire agree on: the default port, chunk and message sizes, and
the largest description and header a server accepts."""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_PORT = 50051
DEFAULT_CHUNK_BYTES = 1 * MiB
MIN_CHUNK_BYTES = 64 * KiB
MAX_CHUNK_BYTES = 3 * MiB  # stays well below gRPC's 4 MiB default message limit
# Received messages may be up to 4 MiB of chunk plus framing, so the server accepts a bit more.
MAX_MESSAGE_BYTES = 8 * MiB
# Options of a channel to a server (a client's, a relay's to its upstream): messages as large as
# the server's, and a reconnect within a second of a restarted server coming back (gRPC's
# default backoff grows to two minutes, which would keep a collector on old weights that long).
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The largest message a gRPC client receives with default settings.
CLIENT_MESSAGE_BYTES = 4 * MiB
# A version's description (VersionInfo: tensor list with digests, metadata) as GetLatest,
# Describe, Fetch and Watch send it. A quarter of a client message, so that the replies that
# carry several (a publish's, which has the first twice, and ListVersions with the default
# --keep 3) fit too.
MAX_DESCRIPTION_BYTES = 1 * MiB
# What the descriptions in one reply may add up to, below CLIENT_MESSAGE_BYTES by the reply's
# own framing. A publish that would make a Publish or ListVersions reply larger is refused.
MAX_DESCRIPTIONS_PER_REPLY = CLIENT_MESSAGE_BYTES - 64 * KiB
# The server's limits on a published safetensors header, agreeing with MAX_DESCRIPTION_BYTES:
# a description takes at least 43 bytes per tensor (a one-character name, dtype and xxh3), so
# more tensors can never be described; the header's JSON takes at most about twice the bytes of
# the description per tensor, and the rest leaves room for the file's own __metadata__.
PUBLISH_MAX_TENSORS = MAX_DESCRIPTION_BYTES // 43
PUBLISH_MAX_HEADER_BYTES = 4 * MAX_DESCRIPTION_BYTES
