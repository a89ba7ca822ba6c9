"""``raykv.transport.auth``: both sides accept exactly when they hold the same secret; the
secret never crosses the wire; a tampered, replayed or truncated frame is refused."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import ConfigError
from raykv.transport import auth

secrets_ = st.binary(min_size=auth.MIN_SECRET_BYTES, max_size=64)


class Pipe:
    """Two in-memory half-duplex channels; records every frame (the transcript)."""

    def __init__(self, tamper=None) -> None:
        self.q = {"s": asyncio.Queue(), "c": asyncio.Queue()}
        self.transcript: list[bytes] = []
        self.tamper = tamper or (lambda i, f: f)

    def ends(self, me: str, peer: str):
        async def send(frame: bytes) -> None:
            frame = self.tamper(len(self.transcript), frame)
            self.transcript.append(frame)
            await self.q[peer].put(frame)

        async def recv(n: int) -> bytes:
            frame = await asyncio.wait_for(self.q[me].get(), 0.05)
            if len(frame) != n:  # as UCX: a receive of the wrong size fails
                raise auth.AuthError(f"expected {n} bytes, got {len(frame)}")
            return frame

        return send, recv


def run(server_secret: bytes, client_secret: bytes, tamper=None):
    pipe = Pipe(tamper)

    async def both():
        return await asyncio.gather(
            auth.serve_handshake(server_secret, *pipe.ends("s", "c")),
            auth.client_handshake(client_secret, *pipe.ends("c", "s")),
            return_exceptions=True,
        )

    server, client = asyncio.run(both())
    return server, client, pipe.transcript


@settings(max_examples=50, deadline=None)
@given(a=secrets_, b=secrets_)
def test_both_sides_accept_exactly_when_the_secrets_match(a, b) -> None:
    server, client, transcript = run(a, b)
    if a == b:
        assert server is None and client is None
    else:
        assert isinstance(server, auth.AuthError)  # the server refuses the client...
        assert isinstance(client, auth.AuthError)  # ...and the client the server's decoy
    for secret in {a, b}:  # the secret never crosses the wire
        assert all(secret not in frame for frame in transcript)
    assert [len(f) for f in transcript] == [auth.HELLO, auth.ANSWER, auth.PROOF]


@settings(max_examples=50, deadline=None)
@given(secret=secrets_, frame=st.integers(0, 2), at=st.integers(0, 95), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(secret, frame, at, bit) -> None:
    def tamper(i: int, f: bytes) -> bytes:
        if i != frame or at >= len(f):
            return f
        b = bytearray(f)
        b[at] ^= 1 << bit
        return bytes(b)

    server, client, _ = run(secret, secret, tamper)
    touched = at < [auth.HELLO, auth.ANSWER, auth.PROOF][frame]
    if touched:
        assert isinstance(client, auth.AuthError)
        if frame == 1:  # the client's proof: the server refuses it too
            assert isinstance(server, auth.AuthError)
    else:
        assert server is None and client is None


@settings(max_examples=25, deadline=None)
@given(secret=secrets_)
def test_a_recorded_answer_is_useless_against_a_fresh_challenge(secret) -> None:
    frame1, ns = auth.hello()
    frame2, _ = auth.answer(secret, frame1)
    assert auth.prove(secret, ns, frame2) is not None
    _, ns2 = auth.hello()
    assert ns2 != ns and auth.prove(secret, ns2, frame2) is None
    # the server's proof is never valid as a client's answer (different labels)
    proof = auth.prove(secret, ns, frame2)
    assert auth.prove(secret, ns, frame2[: auth.NONCE] + proof) is None


def test_a_peer_that_is_not_raykv_or_sends_short_frames_is_refused() -> None:
    with pytest.raises(auth.AuthError, match="greeting"):
        auth.answer(b"k" * 32, b"HTTP/1.1 200 OK" + b"\0" * 21)
    assert auth.prove(b"k" * 32, b"n" * 32, b"short") is None


def test_secrets_are_checked_and_read_from_the_environment() -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        auth.check_secret("short")
    assert auth.secret_from_env({}) is None
    assert auth.secret_from_env({auth.SECRET_ENV: "x" * 20}) == b"x" * 20


def test_raykv_up_keeps_one_owner_only_secret_next_to_the_token(tmp_path) -> None:
    from raykv.service.control.ray_join import ensure_transport_secret, transport_secret_path

    path = transport_secret_path(tmp_path / "auth_token")
    first = ensure_transport_secret(path)
    assert path.parent == tmp_path and (path.stat().st_mode & 0o777) == 0o600
    assert ensure_transport_secret(path) == first and auth.check_secret(first)
