"""One log line per finished call: `<event> k=v ... peer=P client=C`."""

from __future__ import annotations

import logging

import grpc

from weightserver.protocol.errors import CLIENT_ID_METADATA_KEY

# The servicer's logger, the name operators and tests filter publish and fetch lines on.
log = logging.getLogger("weightserver.service.servicer")


def log_event(event: str, context: grpc.aio.ServicerContext, **fields: object) -> None:
    """Log `event` with `fields` (floats to 0.1); the record also carries them, `peer` and
    `client_id` as extra fields, for --log-format json."""
    peer, client_id = context.peer(), client_id_of(context)
    pairs = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    extra = {"event": event, **fields, "peer": peer, "client_id": client_id}
    log.info("%s %s peer=%s client=%s", event, pairs, peer, client_id or "-", extra=extra)


def client_id_of(context: grpc.aio.ServicerContext) -> str | None:
    """The id the caller gave in the `weightserver-client-id` metadata, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_METADATA_KEY:
            return str(value)
    return None
