"""The gate's answers as plain typed values (the wire messages are in ``oncegate.v1``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "Completed",
    "Granted",
    "InProgress",
    "Mismatch",
    "OnceResult",
    "Outcome",
    "Previous",
    "Renewed",
    "Reserved",
    "State",
    "View",
]


class Outcome(enum.IntEnum):
    """How a completed key ended (the wire numbers of ``oncegate.v1.Outcome``)."""

    UNSPECIFIED = 0
    SUCCEEDED = 1
    FAILED = 2


class State(enum.IntEnum):
    """A key's state, as ``get`` reports it (``oncegate.v1.State``)."""

    UNSPECIFIED = 0
    FREE = 1
    PENDING = 2
    ABANDONED = 3
    COMPLETED = 4


class Previous(enum.IntEnum):
    """Whether an attempt before a grant was abandoned (``oncegate.v1.Previous``)."""

    NONE = 0
    ABANDONED = 1


@dataclass(frozen=True)
class Granted:
    """Proceed: the caller holds the key with ``token`` until the lease ends.

    ``lease_ms`` is the lease's length: the request's ``lease_ms``, or the server's
    ``lease_ms_default`` when the request sent 0; 0 from a server older than the field.
    A holder heartbeats every third of it.
    """

    token: int
    attempt: int
    lease_until_ms: int
    expires_at_ms: int
    previous: Previous
    lease_ms: int = 0


@dataclass(frozen=True)
class InProgress:
    """Another attempt holds the key; look again after ``retry_after_ms``."""

    attempt: int
    lease_until_ms: int
    retry_after_ms: int


@dataclass(frozen=True)
class Completed:
    """The key was completed; what the first attempt stored."""

    token: int
    outcome: Outcome
    response: bytes
    completed_at_ms: int
    expires_at_ms: int


@dataclass(frozen=True)
class Mismatch:
    """The key exists with another request's fingerprint."""

    expires_at_ms: int


Answer = Union[Granted, InProgress, Completed, Mismatch]


@dataclass(frozen=True)
class Reserved:
    """A reserve's answer: the key the record lives under (the derived one when key parts
    were sent, or the previous bucket's under bucket grace) and what the gate decided."""

    key: str
    answer: Answer


@dataclass(frozen=True)
class Renewed:
    """A heartbeat's answer (deadlines in the server's clock frame)."""

    lease_until_ms: int
    expires_at_ms: int


@dataclass(frozen=True)
class View:
    """A key's state as ``get`` reads it (``FREE`` with zeros for no live record)."""

    state: State
    token: int
    attempt: int
    lease_until_ms: int
    expires_at_ms: int
    outcome: Outcome
    response: bytes


@dataclass(frozen=True)
class OnceResult:
    """What ``once`` (or a guarded block) ended with, when it did not raise.

    Attributes:
        key: the key that answered (the derived one for key parts; the previous
            bucket's under bucket grace). Use it to name the record.
        token: the fencing token of the attempt whose outcome this is.
        outcome: ``SUCCEEDED`` here; a failure, stored now or replayed, is raised
            (:class:`~oncegate.Final` / :class:`~oncegate.ReplayedFailure`) so that it never
            reads as a success.
        response: the stored response bytes.
        replayed: ``True`` when an earlier attempt completed the key and this is its
            stored answer (the work did not run now).
        completed_at_ms: when the replayed attempt completed (server clock); ``None`` for
            a work that ran now.
        attempt: the attempt number of a work that ran now (``None`` for a replay).
        previous: for a work that ran now, whether an attempt before it was abandoned.
        expires_at_ms: until when the record is remembered.
    """

    key: str
    token: int
    outcome: Outcome
    response: bytes
    replayed: bool
    completed_at_ms: Optional[int]
    attempt: Optional[int]
    previous: Previous
    expires_at_ms: int
