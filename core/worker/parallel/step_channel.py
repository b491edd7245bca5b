"""How rank 0 hands its messages (setup, runner spec, one pickled step each) to the other tensor-parallel ranks.

Both transports give each side a :class:`multiprocessing.connection.Connection`
(length-prefixed messages; end of file when the other side closes), so the
rank's loop is the same whichever carried it:

- a **pipe**, when rank 0 starts the ranks itself on its own machine
  (:func:`open_pipe`): a rank sees end of file when rank 0 exits or dies;
- a **TCP connection**, when the ranks are launched apart (``torchrun``, one
  or more machines): rank 0 listens on ``runtime.master_addr`` at a port the
  system picks (:class:`StepListener`), publishes it in the run's
  torch.distributed store, and each rank connects (:func:`connect_to_rank_0`),
  proves it knows a secret rank 0 put in the same store and says its rank.

The messages are pickles, which run code when loaded: a TCP channel is only
for the ranks of one job on a trusted network (the secret keeps out stray
connections, not someone who can read the store).  Nothing is sent idle, so
an idle server never times out, and a closed connection is noticed at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from multiprocessing.connection import Connection

import torch.distributed as dist

ADDRESS_KEY = "patchbay/steps/address"
SECRET_KEY = "patchbay/steps/secret"
_CHALLENGE_BYTES = 32
_POLL_SECONDS = 0.05
_HANDSHAKE_SECONDS = 10.0
"""How long a connection may take to answer the challenge: a stray one cannot hold up the ranks for longer."""


class StepChannelError(RuntimeError):
    """A rank could not reach rank 0's step channel, or rank 0 never heard from a rank."""


def open_pipe() -> tuple[int, Connection]:
    """A pipe for a child rank: the read end's file descriptor (to pass to the child) and rank 0's writing end."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


def pipe_end(fd: int) -> Connection:
    """The child's reading end of :func:`open_pipe`'s pipe, from its inherited file descriptor."""
    return Connection(fd, writable=False)


def peer_closed(connection: Connection) -> bool:
    """Whether the other side closed ``connection``, on which it never writes (so readable means end of file)."""
    try:
        return connection.poll(0)
    except OSError:
        return True


def _proof(secret: bytes, challenge: bytes, rank: int) -> bytes:
    return hmac.new(secret, challenge + rank.to_bytes(4, "big"), hashlib.sha256).digest()


class StepListener:
    """Rank 0's end of a TCP step channel: a listening socket whose address and secret are in the run's store."""

    def __init__(self, host: str, store: dist.Store) -> None:
        """Listen on ``host`` (rank 0's address as the ranks reach it) and publish where, with a fresh secret."""
        self._secret = secrets.token_bytes(32)
        self._socket = socket.create_server((host, 0))
        self._socket.settimeout(_POLL_SECONDS)
        port = self._socket.getsockname()[1]
        store.set(SECRET_KEY, self._secret)  # type: ignore[arg-type]  # torch's stub says str; Store takes bytes too
        store.set(ADDRESS_KEY, f"{host}:{port}")

    def accept(self, ranks: set[int], timeout: float) -> dict[int, Connection]:
        """One authenticated connection from each of ``ranks``, waiting up to ``timeout`` seconds in all.

        A connection that fails the handshake is dropped; a rank not heard
        from in time is a :class:`StepChannelError` naming it.
        """
        deadline = time.monotonic() + timeout
        connected: dict[int, Connection] = {}
        try:
            while len(connected) < len(ranks):
                if time.monotonic() > deadline:
                    missing = sorted(ranks - connected.keys())
                    raise StepChannelError(
                        f"tensor-parallel rank {missing[0]} did not connect to rank 0 within {timeout:g} s "
                        f"(runtime.distributed_timeout); ranks still missing: {missing}"
                    )
                try:
                    peer, _ = self._socket.accept()
                except TimeoutError:
                    continue
                rank, connection = self._handshake(peer, deadline)
                if rank is None or rank not in ranks or rank in connected:
                    connection.close()
                    continue
                connected[rank] = connection
        except BaseException:
            for connection in connected.values():
                connection.close()
            raise
        return connected

    def _handshake(self, peer: socket.socket, deadline: float) -> tuple[int | None, Connection]:
        peer.settimeout(None)
        connection = Connection(peer.detach())
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        try:
            connection.send_bytes(challenge)
            if not connection.poll(max(0.0, min(_HANDSHAKE_SECONDS, deadline - time.monotonic()))):
                return None, connection
            reply = connection.recv_bytes(64)
        except (OSError, EOFError):
            return None, connection
        rank = int.from_bytes(reply[:4], "big")
        if not hmac.compare_digest(reply[4:], _proof(self._secret, challenge, rank)):
            return None, connection
        return rank, connection

    def close(self) -> None:
        """Stop listening (the accepted connections stay open)."""
        self._socket.close()


def connect_to_rank_0(store: dist.Store, rank: int) -> Connection:
    """Rank ``rank``'s end of the TCP step channel, found and authenticated through the run's store.

    ``store.get`` waits (up to the store's timeout) until rank 0 has published the channel.
    """
    address = store.get(ADDRESS_KEY).decode()
    secret = store.get(SECRET_KEY)
    host, _, port = address.rpartition(":")
    try:
        peer = socket.create_connection((host, int(port)))
    except OSError as exc:
        raise StepChannelError(
            f"tensor-parallel rank {rank} cannot reach rank 0's step channel at {address}: {exc}"
        ) from exc
    connection = Connection(peer.detach())
    try:
        challenge = connection.recv_bytes(_CHALLENGE_BYTES)
        connection.send_bytes(rank.to_bytes(4, "big") + _proof(secret, challenge, rank))
    except (OSError, EOFError) as exc:
        connection.close()
        raise StepChannelError(
            f"rank 0's step channel at {address} closed during tensor-parallel rank {rank}'s handshake: {exc}"
        ) from exc
    return connection
