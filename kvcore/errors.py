"""Mooncake integer status codes turned into typed exceptions, in one place.

Mooncake's Python bindings return ints (0 or a byte count on success, a negative
``ErrorCode`` on failure). Everything in this project calls :func:`check` (or
:func:`error_for`) instead of comparing integers itself.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A connector or tool configuration is wrong (unknown key, bad type, bad value)."""


class TransferTimeout(TimeoutError):
    """A load, pull or handshake did not finish before its deadline."""


class MooncakeError(RuntimeError):
    """A Mooncake call returned a negative status code."""

    code: int = -1
    name: str = "INTERNAL_ERROR"

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
        return _CAUSES.get(type(self), "error")


class NoSpace(MooncakeError):
    code, name = -200, "NO_AVAILABLE_HANDLE"


class InvalidParams(MooncakeError):
    code, name = -600, "INVALID_PARAMS"


class ReplicaNotReady(MooncakeError):
    code, name = -703, "REPLICA_IS_NOT_READY"


class ObjectNotFound(MooncakeError):
    code, name = -704, "OBJECT_NOT_FOUND"


class ObjectExists(MooncakeError):
    code, name = -705, "OBJECT_ALREADY_EXISTS"


class ObjectHasLease(MooncakeError):
    code, name = -706, "OBJECT_HAS_LEASE"


class LeaseExpired(MooncakeError):
    code, name = -707, "LEASE_EXPIRED"


class TransferFailed(MooncakeError):
    code, name = -800, "TRANSFER_FAIL"


class RpcFailed(MooncakeError):
    code, name = -900, "RPC_FAIL"


class RpcTimeout(MooncakeError):
    code, name = -901, "RPC_TIMEOUT"


_BY_CODE: dict[int, type[MooncakeError]] = {
    cls.code: cls
    for cls in (
        NoSpace,
        InvalidParams,
        ReplicaNotReady,
        ObjectNotFound,
        ObjectExists,
        ObjectHasLease,
        LeaseExpired,
        TransferFailed,
        RpcFailed,
        RpcTimeout,
    )
}

_CAUSES: dict[type, str] = {
    NoSpace: "no_space",
    InvalidParams: "invalid_params",
    ReplicaNotReady: "not_ready",
    ObjectNotFound: "not_found",
    ObjectExists: "exists",
    ObjectHasLease: "has_lease",
    LeaseExpired: "lease_expired",
    TransferFailed: "transfer",
    RpcFailed: "rpc",
    RpcTimeout: "rpc",
    MooncakeError: "error",
}

# Codes whose failure means "the object is not (fully) there": a reader treats
# them as a miss and recomputes, never as corrupt data.
MISSING_CODES = frozenset({-703, -704, -707})


def error_for(code: int, op: str, detail: str = "") -> MooncakeError:
    cls = _BY_CODE.get(code)
    if cls is None:
        return MooncakeError(op, code, detail)
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
