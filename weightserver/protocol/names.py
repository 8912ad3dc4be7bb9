"""Names a client chooses: model names (they become directory names) and publish ids."""

from __future__ import annotations

import re

from weightserver.protocol.errors import InvalidModelName, InvalidRequest, clipped_repr

MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
PUBLISH_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces


def validate_model_name(model: str) -> str:
    """`model` if it is a safe model name, else InvalidModelName: names become directory names
    under --data-dir, so the rules keep them inside it."""
    if not isinstance(model, str) or not MODEL_NAME.fullmatch(model) or ".." in model:
        raise InvalidModelName(
            f"invalid model name {clipped_repr(model)}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "not starting with '.' or '-' and without '..'"
        )
    return model


def validate_publish_id(publish_id: str) -> str:
    """`publish_id` if it is empty (none) or a valid idempotency key, else InvalidRequest."""
    if publish_id and not PUBLISH_ID.fullmatch(publish_id):
        raise InvalidRequest(
            f"invalid publish id {publish_id[:200]!r}: use 1-128 printable ASCII characters without spaces "
            "(e.g. a random UUID), or none"
        )
    return publish_id
