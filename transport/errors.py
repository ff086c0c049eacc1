"""Errors raised by :mod:`transport`."""

from __future__ import annotations

__all__ = ["PeerTimeoutError", "ProtocolError", "TransportError"]


class TransportError(Exception):
    """Root of every transport error."""


class PeerTimeoutError(TransportError, TimeoutError):
    """A wait on a peer (an MPI daemon or the socket's other end) outlived its timeout.

    MPI cannot survive a dead rank here, so the storage job treats this as fatal for itself: its
    state stays in shared memory for the relaunched job to adopt.
    """


class ProtocolError(TransportError, ValueError):
    """A control message that is not what the protocol allows (bad frame, bad JSON, too big)."""
