"""Exceptions raised by libdsec.

Every failure the service reports arrives as a Connect error code; each code
gets its own exception class so callers can write ``except NotFoundError``
instead of comparing strings. Transport failures (refused connection, broken
stream, client-side timeout) are raised as the Connect code that describes
them (``unavailable``, ``deadline_exceeded``) so that callers only ever need
to catch :class:`DSecError`.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = [
    "DSecError",
    "CanceledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
    "error_for",
    "parse_retry_after",
]


class DSecError(Exception):
    """A call failed. ``code`` is the Connect code name (e.g. ``"not_found"``).

    ``retry_after`` is the number of seconds the service asked the caller
    to wait before trying again, or None. The service sets it with
    ``unavailable`` when it is saturated (no capacity, and its admission
    queue is full): the call was not run. libdsec never re-sends a create
    by itself; the caller decides whether to come back after
    ``retry_after`` seconds, go elsewhere or give up.
    """

    code = "unknown"
    # True when the request failed in transit (connection refused or reset,
    # no response in time, a stream cut short) rather than being answered:
    # the server may or may not have acted on it. Numbered operations are
    # re-sent on such failures (see DSecClient.exec).
    transport_failure = False

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        http_status: Optional[int] = None,
        retry_after: Optional[float] = None,
    ):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.http_status = http_status
        self.retry_after = retry_after if retry_after is not None else parse_retry_after(message, in_text=True)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class CanceledError(DSecError):
    code = "canceled"


class UnknownError(DSecError):
    code = "unknown"


class InvalidArgumentError(DSecError):
    code = "invalid_argument"


class DeadlineExceededError(DSecError):
    code = "deadline_exceeded"


class NotFoundError(DSecError):
    code = "not_found"


class AlreadyExistsError(DSecError):
    code = "already_exists"


class PermissionDeniedError(DSecError):
    code = "permission_denied"


class ResourceExhaustedError(DSecError):
    code = "resource_exhausted"


class FailedPreconditionError(DSecError):
    code = "failed_precondition"


class AbortedError(DSecError):
    code = "aborted"


class OutOfRangeError(DSecError):
    code = "out_of_range"


class UnimplementedError(DSecError):
    code = "unimplemented"


class InternalError(DSecError):
    code = "internal"


class UnavailableError(DSecError):
    code = "unavailable"


class DataLossError(DSecError):
    code = "data_loss"


class UnauthenticatedError(DSecError):
    code = "unauthenticated"


_BY_CODE = {
    cls.code: cls
    for cls in (
        CanceledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}

# The Connect protocol's fallback when an HTTP response carries no Connect
# error body (a proxy or load balancer answered instead of the server).
_BY_HTTP_STATUS = {
    400: "internal",
    401: "unauthenticated",
    403: "permission_denied",
    404: "unimplemented",
    429: "unavailable",
    502: "unavailable",
    503: "unavailable",
    504: "unavailable",
}

# Codes that say the infrastructure failed rather than the request being
# wrong: an exec that ends this way is reported as an infra_error result.
INFRA_CODES = frozenset({"unavailable", "deadline_exceeded", "internal", "unknown", "aborted", "data_loss"})


def error_for(
    code: Optional[str], message: str, http_status: Optional[int] = None, retry_after: Optional[float] = None
) -> DSecError:
    """Returns the exception for a Connect error code (or, lacking one, an HTTP status).

    ``retry_after`` (seconds) is the service's hint from the Retry-After
    header; without one it is looked for in the message, which is all a
    per-item error of a batch call carries."""
    if not code:
        code = _BY_HTTP_STATUS.get(http_status or 0, "unknown")
    cls = _BY_CODE.get(code, DSecError)
    return cls(message, code=code, http_status=http_status, retry_after=retry_after)


# "retry after 2s", "Retry-After: 1.5", "retry_after=500ms" in a message.
_RETRY_AFTER_TEXT = re.compile(r"retry[-_ ]?after[:= ]*([0-9]+(?:\.[0-9]+)?)(ms|s)?\b", re.IGNORECASE)


def parse_retry_after(value: Optional[str], *, in_text: bool = False) -> Optional[float]:
    """Seconds from a Retry-After header value ("2", "0.5"), or with
    ``in_text`` from a message that mentions one; None when there is none.
    (An HTTP date, which the header may hold in general, is not used by
    DSec.)"""
    if not value:
        return None
    if in_text:
        m = _RETRY_AFTER_TEXT.search(value)
        if not m:
            return None
        seconds = float(m.group(1))
        if m.group(2) == "ms":
            seconds /= 1000
    else:
        try:
            seconds = float(value.strip())
        except ValueError:
            return None
    if not 0 <= seconds <= 86400:
        return None
    return seconds
