"""Mutual challenge-response authentication of a transport connection (HMAC-SHA256).

Both ends hold the same transport secret (``RAYKV_TRANSPORT_SECRET`` on every node: the Helm
chart's Secret, or the one ``raykv up`` generates). Before any block moves, three fixed-size
frames cross the connection; the secret itself never does:

1. server -> client: ``MAGIC`` + a fresh 32-byte nonce ``ns``
2. client -> server: a fresh nonce ``nc`` + ``HMAC(secret, "client" | ns | nc)``
3. server -> client: ``HMAC(secret, "server" | ns | nc)`` if the client's proof is right,
   else 32 random bytes (no oracle), and the server closes the connection.

Each side checks the other's proof with ``hmac.compare_digest``; both nonces are fresh per
connection, so a recorded exchange cannot be replayed, and the two proofs carry different
labels, so one side's proof is never valid as the other's. A peer that answers wrong, too
late (the caller bounds the handshake with a timeout) or not at all reads nothing and writes
nothing. ``serve_handshake`` / ``client_handshake`` run over any pair of ``send(bytes)`` /
``recv(n) -> bytes`` coroutines, so the protocol is tested without a network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping

from raykv.errors import ConfigError, TransportError

MAGIC = b"RKV1"
NONCE = 32
MAC = 32
HELLO = len(MAGIC) + NONCE  # frame 1
ANSWER = NONCE + MAC  # frame 2
PROOF = MAC  # frame 3
MIN_SECRET_BYTES = 16
SECRET_ENV = "RAYKV_TRANSPORT_SECRET"

Send = Callable[[bytes], Awaitable[None]]
Recv = Callable[[int], Awaitable[bytes]]


class AuthError(TransportError):
    """The peer did not prove it holds the transport secret (or spoke another protocol)."""


def check_secret(secret: bytes | str) -> bytes:
    """The secret as bytes; ConfigError if it is too short to be one."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the transport secret has {len(raw)} bytes, at least {MIN_SECRET_BYTES} are needed; "
            f"set {SECRET_ENV} to a random string (e.g. python -c 'import secrets; "
            "print(secrets.token_hex(32))')"
        )
    return raw


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The node's transport secret (``RAYKV_TRANSPORT_SECRET``), or None when it is unset
    (then no authenticated transport runs: blocks move over the object store)."""
    value = (os.environ if env is None else env).get(SECRET_ENV, "")
    return check_secret(value) if value else None


def _mac(secret: bytes, label: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(secret, label + ns + nc, hashlib.sha256).digest()


def hello() -> tuple[bytes, bytes]:
    """Frame 1 and the server's nonce."""
    ns = secrets.token_bytes(NONCE)
    return MAGIC + ns, ns


def answer(secret: bytes, frame1: bytes) -> tuple[bytes, bytes]:
    """The client's frame 2 for ``frame1``, and the proof it expects back (frame 3)."""
    if len(frame1) != HELLO or not hmac.compare_digest(frame1[: len(MAGIC)], MAGIC):
        raise AuthError("the peer is not a raykv transport endpoint (bad greeting)")
    ns, nc = frame1[len(MAGIC) :], secrets.token_bytes(NONCE)
    return nc + _mac(secret, b"client", ns, nc), _mac(secret, b"server", ns, nc)


def prove(secret: bytes, ns: bytes, frame2: bytes) -> bytes | None:
    """The server's frame 3 if ``frame2`` proves the secret, else None."""
    if len(frame2) != ANSWER:
        return None
    nc, mac = frame2[:NONCE], frame2[NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", ns, nc)):
        return None
    return _mac(secret, b"server", ns, nc)


async def serve_handshake(secret: bytes, send: Send, recv: Recv) -> None:
    """The server's side; AuthError if the client does not hold ``secret``."""
    frame1, ns = hello()
    await send(frame1)
    proof = prove(secret, ns, await recv(ANSWER))
    if proof is None:
        await send(secrets.token_bytes(PROOF))  # the client learns nothing from it
        raise AuthError("the client's proof does not match this node's transport secret")
    await send(proof)


async def client_handshake(secret: bytes, send: Send, recv: Recv) -> None:
    """The client's side; AuthError if the server does not hold ``secret``."""
    frame2, expected = answer(secret, await recv(HELLO))
    await send(frame2)
    if not hmac.compare_digest(await recv(PROOF), expected):
        raise AuthError(
            "the server refused this node's transport secret or does not hold it; give every "
            f"node the same {SECRET_ENV}"
        )
