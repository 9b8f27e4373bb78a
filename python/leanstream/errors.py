"""Exceptions for the daemon's errors.

leanstreamd refuses a call with a D-Bus error named
``io.github.leanstream.LeanStream1.Error.<Name>``, and a token stream that fails ends with an
``{"error": {"name": "<Name>", ...}}`` event. Both become the same exception class here, so an
app writes one ``except leanstream.OverBudget`` whether the refusal came from the call or from
the stream.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

ERROR_PREFIX = "io.github.leanstream.LeanStream1.Error."

# What the bus itself answers when nothing owns the daemon's name: the daemon is not running.
_UNREACHABLE_NAMES = {
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
}


class LeanStreamError(Exception):
    """Base of every error this package raises.

    ``name`` is the full D-Bus error name (``io.github.leanstream.LeanStream1.Error.Busy``, or a
    bus error such as ``org.freedesktop.DBus.Error.AccessDenied``), or ``None`` for an error
    found on this side (a truncated stream, an option of the wrong Python type).
    ``message`` is the daemon's explanation.
    """

    def __init__(self, message: str = "", name: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.name = name

    def __str__(self) -> str:
        short = self.name.rsplit(".", 1)[-1] if self.name else type(self).__name__
        return f"{short}: {self.message}" if self.message else short


class ModelNotFound(LeanStreamError):
    """No model of that name in the daemon's model directory."""


class InvalidArgument(LeanStreamError, ValueError):
    """An argument the daemon (or this package, before sending) refuses: an unknown option key,
    an option of the wrong type or out of range, a grammar that does not compile. It is also a
    ``ValueError`` so generic argument checking catches it."""


class OverBudget(LeanStreamError):
    """The request does not fit in the daemon's memory budget."""


class Busy(LeanStreamError):
    """The daemon is at a limit (sessions, pins, calls in flight) or the model is loading or in
    use; retry later."""


class InvalidModel(LeanStreamError):
    """The model file (or the daemon's settings for it) cannot be served."""


class AccessDenied(LeanStreamError):
    """Not allowed for this user: e.g. ``realtime`` priority for an ordinary user, or another
    connection's session."""


class Cancelled(LeanStreamError):
    """The generation was cancelled (``Cancel()``, ``Close()``) before it finished."""


class Internal(LeanStreamError):
    """The daemon could not do it: an I/O or device error on its side."""


class Unreachable(LeanStreamError):
    """The bus cannot be reached, or no leanstreamd owns its name on it."""


class Truncated(LeanStreamError):
    """The token stream ended without a ``done`` or ``error`` event: the daemon stopped."""


_BY_SHORT_NAME: Dict[str, Type[LeanStreamError]] = {
    cls.__name__: cls
    for cls in (ModelNotFound, InvalidArgument, OverBudget, Busy, InvalidModel, AccessDenied,
                Cancelled, Internal)
}


def error_from_name(name: str, message: str = "") -> LeanStreamError:
    """The exception for an error name: a full D-Bus name or the short name a stream's
    ``error`` event carries. Unknown names (a newer daemon's) give the base class, keeping the
    name, so nothing is lost."""
    short = name[len(ERROR_PREFIX):] if name.startswith(ERROR_PREFIX) else name
    full = name if "." in name else ERROR_PREFIX + name
    if name in _UNREACHABLE_NAMES:
        return Unreachable(message or "no leanstreamd on this bus", name)
    cls = _BY_SHORT_NAME.get(short, LeanStreamError)
    return cls(message, full)
