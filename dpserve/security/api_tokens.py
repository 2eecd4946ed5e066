"""The HTTP front's bearer tokens: the API key files (``--api-key-file``, and
``--admin-api-key-file`` for the admin endpoints) and checking an ``Authorization`` header
against them (``ApiKeys.authorize``: who may call what is decided here, nowhere else)."""

from __future__ import annotations

import dataclasses
import enum
import hmac
import os
from pathlib import Path
from typing import Final

from dpserve.security.key_files import CredentialsError

ENV_API_KEY_FILE: Final = "DPSERVE_API_KEY_FILE"
ENV_ADMIN_API_KEY_FILE: Final = "DPSERVE_ADMIN_API_KEY_FILE"


def load_api_keys(path: str | os.PathLike[str]) -> tuple[bytes, ...]:
    """Accepted bearer tokens: one per line (several allow rotation); blank lines and
    ``#`` comments are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"cannot read the API key file {path}: {exc}") from None
    tokens = tuple(
        line.strip().encode()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise CredentialsError(f"the API key file {path} holds no token")
    return tokens


def bearer_token_matches(authorization: str | None, tokens: tuple[bytes, ...]) -> bool:
    """Does an ``Authorization`` header carry one of ``tokens``? Every token is compared in
    constant time, so the answer's timing tells nothing about how close a guess was."""
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    candidate = presented.strip().encode("utf-8", "replace")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(candidate, token)
    return matched


class Access(enum.Enum):
    """What a request's token allows on the path it asks for."""

    ALLOWED = "allowed"
    UNAUTHENTICATED = "unauthenticated"  # no token, or not one of ours: 401
    NOT_ADMIN = "not_admin"  # an API token on an admin endpoint: 403


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """The front's tokens. ``api``: may use the API (``/v1/*``). ``admin``: may use it too,
    and is the only token the admin endpoints (loading and unloading LoRA adapters, which
    point the engines at directories) take: an API token there is refused, also when no
    admin token is configured. With ``admin`` alone the API stays open, as without keys."""

    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    def __repr__(self) -> str:  # never the tokens, in logs or tracebacks
        return f"ApiKeys(api={len(self.api)} token(s), admin={len(self.admin)} token(s))"

    def authorize(self, authorization: str | None, *, admin_endpoint: bool) -> Access:
        """May the ``Authorization`` header's token call an API path (an admin endpoint or
        not)? Both token lists are compared, in constant time each."""
        admin = bearer_token_matches(authorization, self.admin)
        api = bearer_token_matches(authorization, self.api)
        if admin:
            return Access.ALLOWED
        if admin_endpoint:
            return Access.NOT_ADMIN if api else Access.UNAUTHENTICATED
        return Access.ALLOWED if api or not self.api else Access.UNAUTHENTICATED
