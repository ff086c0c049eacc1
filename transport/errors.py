"""Errors raised by :mod:`transport`."""

from __future__ import annotations

__all__ = ["PeerTimeoutError", "ProtocolError", "TransportError"]


class TransportError(Exception):
    """Root of every transport error."""


class PeerTimeoutError(TransportError, TimeoutError):
    """A wait on a peer (an MPI daemon or the socket's other end) outlived its timeout.

    ``peers`` are the ranks (of the communicator waited on) whose point-to-point messages had
    not completed: the silent ones; empty for a collective, which cannot say who is missing.
    MPI cannot survive a dead rank here, so the storage job treats this as fatal for itself: its
    state stays in shared memory for the relaunched job to adopt.
    """

    def __init__(self, message: str, peers: list[int] | None = None) -> None:
        super().__init__(message)
        self.peers = sorted(set(peers or []))
        self.links = ""  # the name of the links (communicator) the peers are ranks of


class ProtocolError(TransportError, ValueError):
    """A control message that is not what the protocol allows (bad frame, bad JSON, too big)."""
