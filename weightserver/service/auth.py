"""Bearer-token authorization: who may call which WeightService method. The token file (one
`ROLE NAME TOKEN` a line; roles reader < publisher < admin, `publisher:policy,critic` scoped to
models) is described in docs/guides/security.md. Tokens are compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from weightserver.protocol.channel import AUTHORIZATION_METADATA_KEY
from weightserver.protocol.errors import AuthenticationRequired, InvalidRequest, PermissionDenied, clipped_repr
from weightserver.protocol.names import validate_model_name

ROLES = ("reader", "publisher", "admin")  # each includes the rights of the ones before it
MIN_TOKEN_CHARS = 16

# The least role that may call each method; one missing here is for admins (a test checks the .proto).
# A publish's Negotiate also needs what Publish needs.
REQUIRED_ROLE: dict[str, str] = {
    **dict.fromkeys(("GetLatest", "Describe", "Fetch", "Negotiate", "Watch", "ListModels", "ListVersions"), "reader"),
    "Publish": "publisher",
    "DeleteVersion": "admin",
    "PinVersion": "admin",
}


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to; `token_sha256` owns the uploads its Negotiate sets up."""

    name: str
    role: str
    models: frozenset[str] | None = None
    token_sha256: bytes = field(default=b"", repr=False, compare=False)


class TokenTable:
    """The tokens a server accepts, held as sha256 digests."""

    def __init__(self, entries: Iterable[tuple[str, str, str]]) -> None:
        self._entries: dict[bytes, Principal] = {}  # by the token's digest
        for scoped_role, name, token in entries:
            role, scoped, scope = scoped_role.partition(":")
            if role not in ROLES:
                raise InvalidRequest(f"token {name!r}: unknown role {role!r}; use one of {', '.join(ROLES)}")
            if scoped and role == "reader":
                raise InvalidRequest(
                    f"token {name!r}: a reader may read every model; only publisher and admin take models"
                )
            try:
                models = frozenset(validate_model_name(model) for model in scope.split(",")) if scoped else None
            except InvalidRequest as exc:
                raise InvalidRequest(f"token {name!r}: {exc}") from None
            if len(token) < MIN_TOKEN_CHARS:
                raise InvalidRequest(f"token {name!r} is shorter than {MIN_TOKEN_CHARS} characters")
            digest = hashlib.sha256(token.encode()).digest()
            if digest in self._entries:
                raise InvalidRequest(f"token {name!r} repeats another entry's token")
            self._entries[digest] = Principal(name, role, models, token_sha256=digest)
        if not self._entries:
            raise InvalidRequest("the token file lists no tokens")

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Parse a token file; errors name the line, never the token."""
        entries = []
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not (fields := line.split("#", 1)[0].split()):
                continue
            if len(fields) != 3:
                raise InvalidRequest(f"{path}:{number}: expected 'ROLE NAME TOKEN', got {len(fields)} fields")
            entries.append((fields[0], fields[1], fields[2]))
        try:
            return cls(entries)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{path}: {exc}") from None

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, token: str) -> Principal | None:
        """The token's principal, or None; every entry is compared, so timing reveals nothing."""
        digest = hashlib.sha256(token.encode()).digest()
        found = [principal for known, principal in self._entries.items() if hmac.compare_digest(known, digest)]
        return found[0] if found else None

    def authorize(self, metadata: Iterable[tuple[str, str]] | None, method: str, model: str | None = None) -> Principal:
        """The caller of `method` (on `model`) if its bearer token allows it (gRPC gives a text key's value as str)."""
        header = next((v for k, v in metadata or () if k == AUTHORIZATION_METADATA_KEY), None)
        if header is None:
            raise AuthenticationRequired(
                "this server requires a token: send 'authorization: Bearer <token>' "
                "(Python client: token= or $WEIGHTSERVER_TOKEN)"
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationRequired("the authorization metadata must be 'Bearer <token>'")
        principal = self.identify(token.strip())
        if principal is None:
            raise AuthenticationRequired("unknown token: check it against the server's --auth-tokens file")
        needed = REQUIRED_ROLE.get(method, "admin")
        if ROLES.index(principal.role) < ROLES.index(needed):
            raise PermissionDenied(
                f"{method} needs the {needed!r} role; the token of {principal.name!r} has {principal.role!r}"
            )
        if needed != "reader" and model is not None and principal.models is not None and model not in principal.models:
            raise PermissionDenied(
                f"{method} of model {clipped_repr(model)}: the token of {principal.name!r} may change only "
                f"{', '.join(sorted(principal.models))}"
            )
        return principal
