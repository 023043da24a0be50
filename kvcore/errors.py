"""Mooncake integer status codes turned into typed exceptions, in one place.

Mooncake's Python bindings return ints (0 or a byte count on success, a negative
``ErrorCode`` on failure). :data:`CODES` has one row per code this project meets;
the exception classes (``NoSpace``, ``ObjectNotFound``, ...) and every predicate are
derived from it. Everything in this project calls :func:`check` / :func:`error_for`
or a predicate (:func:`is_missing`, :func:`is_rpc_down`, :func:`is_no_space`, ...)
instead of comparing integers itself.
"""

from __future__ import annotations

from typing import NamedTuple


class ConfigError(ValueError):
    """A connector or tool configuration is wrong (unknown key, bad type, bad value)."""


class TransferTimeout(TimeoutError):
    """A load, pull or handshake did not finish before its deadline."""


class Code(NamedTuple):
    code: int
    name: str  # Mooncake's ErrorCode name (mooncake-store/include/types.h)
    cls: str  # the exception class raised for it
    cause: str  # short label for metrics ("no_space", "not_found", ...)
    missing: bool = False  # the object is not (fully) there: a reader treats it as a miss and
    #                        recomputes, never as corrupt data
    rpc_down: bool = False  # the master (or the network to it) is not answering


CODES: tuple[Code, ...] = (
    #    code  Mooncake name            class              cause
    Code(-1,   "INTERNAL_ERROR",        "InternalError",   "error",          rpc_down=True),  # is_exist: could not ask
    Code(-200, "NO_AVAILABLE_HANDLE",   "NoSpace",         "no_space"),
    Code(-600, "INVALID_PARAMS",        "InvalidParams",   "invalid_params"),
    Code(-703, "REPLICA_IS_NOT_READY",  "ReplicaNotReady", "not_ready",      missing=True),
    Code(-704, "OBJECT_NOT_FOUND",      "ObjectNotFound",  "not_found",      missing=True),
    Code(-705, "OBJECT_ALREADY_EXISTS", "ObjectExists",    "exists"),
    Code(-706, "OBJECT_HAS_LEASE",      "ObjectHasLease",  "has_lease"),
    Code(-707, "LEASE_EXPIRED",         "LeaseExpired",    "lease_expired",  missing=True),
    Code(-800, "TRANSFER_FAIL",         "TransferFailed",  "transfer"),
    Code(-900, "RPC_FAIL",              "RpcFailed",       "rpc",            rpc_down=True),
    Code(-901, "RPC_TIMEOUT",           "RpcTimeout",      "rpc",            rpc_down=True),
)

_ROWS: dict[int, Code] = {row.code: row for row in CODES}


class MooncakeError(RuntimeError):
    """A Mooncake call returned a negative status code (one not in :data:`CODES` if raised as is)."""

    code: int = 0
    name: str = "UNKNOWN"

    def __init__(self, op: str, code: int | None = None, detail: str = ""):
        if code is not None:
            self.code = code
        self.op = op
        self.detail = detail
        msg = f"{op} failed: {self.name} ({self.code})"
        super().__init__(f"{msg}: {detail}" if detail else msg)

    @property
    def cause(self) -> str:
        """Short label for metrics ("no_space", "not_found", ...)."""
        return cause_of(self.code)


def _make_class(row: Code) -> type[MooncakeError]:
    doc = f"Mooncake {row.name} ({row.code})."
    return type(row.cls, (MooncakeError,), {"code": row.code, "name": row.name, "__doc__": doc,
                                            "__module__": __name__, "__qualname__": row.cls})


# The classes, built from the table and bound under their names (``from kvcore.errors
# import NoSpace`` works as for a class statement).
_BY_CODE: dict[int, type[MooncakeError]] = {row.code: _make_class(row) for row in CODES}
globals().update({cls.__name__: cls for cls in _BY_CODE.values()})


def _code(code_or_exc: int | MooncakeError) -> int:
    return code_or_exc.code if isinstance(code_or_exc, MooncakeError) else int(code_or_exc)


def _row(code_or_exc: int | MooncakeError) -> Code | None:
    return _ROWS.get(_code(code_or_exc))


def _is(code_or_exc: int | MooncakeError, name: str) -> bool:
    row = _row(code_or_exc)
    return bool(row and row.name == name)


def cause_of(code_or_exc: int | MooncakeError) -> str:
    """The metrics label of a failure code ("error" for a code not in the table)."""
    row = _row(code_or_exc)
    return row.cause if row else "error"


def is_missing(code_or_exc: int | MooncakeError) -> bool:
    """The object is not (fully) there (not ready, not found, lease expired): a miss."""
    row = _row(code_or_exc)
    return bool(row and row.missing)


def is_rpc_down(code_or_exc: int | MooncakeError) -> bool:
    """The master (or the network to it) did not answer."""
    row = _row(code_or_exc)
    return bool(row and row.rpc_down)


def is_no_space(code_or_exc: int | MooncakeError) -> bool:
    """The pool is full (eviction runs asynchronously: a short retry may succeed)."""
    return _is(code_or_exc, "NO_AVAILABLE_HANDLE")


def is_not_found(code_or_exc: int | MooncakeError) -> bool:
    """No such object (never stored, evicted, or removed)."""
    return _is(code_or_exc, "OBJECT_NOT_FOUND")


def is_leased(code_or_exc: int | MooncakeError) -> bool:
    """A reader holds a lease on the object: a non-forced remove is refused until it ends."""
    return _is(code_or_exc, "OBJECT_HAS_LEASE")


def is_invalid_params(code_or_exc: int | MooncakeError) -> bool:
    """Mooncake refused the arguments (for a read: buffers of another size than the object)."""
    return _is(code_or_exc, "INVALID_PARAMS")


def error_for(code: int, op: str, detail: str = "") -> MooncakeError:
    cls = _BY_CODE.get(code, MooncakeError)
    return cls(op, code, detail)


def check(rc: int, op: str, detail: str = "") -> int:
    """Return ``rc`` when it is a success (>= 0), raise the typed error otherwise."""
    if rc < 0:
        raise error_for(rc, op, detail)
    return rc


def first_error(rcs: list[int], op: str) -> MooncakeError | None:
    """The typed error for the first negative code of a batch result, if any."""
    for rc in rcs:
        if rc < 0:
            return error_for(rc, op)
    return None
