"""The HTTP front's bearer tokens: the API key file (``--api-key-file``) and checking an
``Authorization`` header against it."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Final

from dpserve.security.key_files import CredentialsError

ENV_API_KEY_FILE: Final = "DPSERVE_API_KEY_FILE"


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
