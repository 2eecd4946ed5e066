"""Roles: which messages each role may send (``PERMITTED``), the ZAP authenticator that gives
every CURVE connection its role, and making sockets CURVE servers and clients.

The coordinator's ROUTER socket is a CURVE server. pyzmq's ZAP authenticator (a thread in the
coordinator process) accepts a connection only if the peer's public key is listed for one of
three roles, and hands the role back to libzmq as the connection's ``User-Id``; every message
received on that connection then carries it as metadata. The coordinator checks the role of
*every* message against ``PERMITTED``, not only of handshakes: a ROUTER frees an identity when
its connection drops, and any other allowed key may then connect under the same identity (see
``tests/integration/test_security.py``), so a role remembered from CONNECT could be borrowed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dpserve.protocol import ADAPTER_SIGNALS, CONTROL_SIGNALS, Header
from dpserve.security.key_files import ADMIN, CLIENT, ENGINE, PeerKeys, ServerKeys

log = logging.getLogger("dpserve.security")

_CLIENT_HEADERS = frozenset(
    {
        Header.CONNECT,
        Header.HEARTBEAT,
        Header.SUBMIT_REQUEST,
        Header.SUBMIT_REQUESTS,
        Header.CANCEL,
        Header.STATUS,
    }
)
# role -> the messages a connection with that role may send to the coordinator.
PERMITTED: Final[Mapping[str, frozenset[Header]]] = {
    ENGINE: frozenset(
        {
            Header.REGISTER,
            Header.HEARTBEAT,
            Header.DRAIN,
            Header.DEREGISTER,
            Header.HAND_OFF,
            Header.ENGINE_REPLY,
            Header.CONTROL_ACK,
            Header.ADAPTER_ACK,
            Header.KV_EVENTS,
        }
    ),
    CLIENT: _CLIENT_HEADERS,
    ADMIN: _CLIENT_HEADERS | CONTROL_SIGNALS | ADAPTER_SIGNALS,
}

# Messages whose first field is the sender's request/control/query id, so a refusal can name it.
_FIRST_FIELD_IS_REF: Final = frozenset(
    {Header.SUBMIT_REQUEST, Header.CANCEL, Header.STATUS, *CONTROL_SIGNALS, *ADAPTER_SIGNALS}
)

_LOG_FIRST, _LOG_EVERY = 10, 1000  # rate limit for repeated warnings


def forbidden(role: str, header: Header, fields: Sequence[Any]) -> tuple[int | None, str]:
    """The id to name and the reason for refusing ``header`` from a ``role`` connection."""
    # Any: the fields are decoded MessagePack that no handler has checked; the ref goes back
    # to the peer as it came.
    ref = fields[0] if header in _FIRST_FIELD_IS_REF else None
    if header in CONTROL_SIGNALS or header in ADAPTER_SIGNALS:
        return ref, f"{header.name} needs the admin role; this connection has the {role} role"
    return ref, f"{header.name} is not allowed for the {role or 'unknown'} role"


class RoleAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, answering with the peer's role as the connection's User-Id."""

    def __init__(self, context: zmq.Context[Any], roles: Mapping[bytes, str]) -> None:
        super().__init__(context, log=logging.getLogger("dpserve.security.zap"))
        self.roles = dict(roles)
        self.denied = 0  # written by the ZAP thread only; read for status

    def curve_user_id(self, client_public_key: bytes) -> str:
        # Only called for keys ``callback`` accepted, so the key is in the map.
        return self.roles[z85.encode(client_public_key)]

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is this (z85) public key allowed at all?"""
        if key in self.roles:
            return True
        self.denied += 1
        if self.denied <= _LOG_FIRST or self.denied % _LOG_EVERY == 0:
            log.warning(
                "refused CURVE connection #%d: public key %s is not allowed for any role",
                self.denied,
                key.decode("ascii", "replace"),
            )
        return False


def secure_server(socket: zmq.Socket[object], keys: ServerKeys) -> RoleAuthenticator:
    """Make ``socket`` (not yet bound) a CURVE server whose peers the returned, running
    authenticator checks. Stop the authenticator before terminating the context."""
    authenticator = RoleAuthenticator(socket.context, keys.roles)
    # Started before the socket accepts anything: libzmq lets every key in when no ZAP
    # handler is bound in the context.
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=authenticator)
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    return authenticator


def secure_peer(socket: zmq.Socket[object], keys: PeerKeys) -> None:
    """Make ``socket`` (not yet connected) a CURVE client of the coordinator."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server_public
