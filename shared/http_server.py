"""uvicorn with a request-header deadline, for both services (slowloris).

uvicorn bounds idle keep-alive connections but not a request whose headers never finish: 200
connections trickling a header byte at a time stayed open for as long as they liked. Here every
connection must complete a request's headers within `header_timeout_s` of being opened (or of its
previous response finishing); otherwise it is closed. Requests being served are not affected.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_BASE: type[asyncio.Protocol]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    _BASE = HttpToolsProtocol                         # uvicorn's own preference
except ImportError:                                  # httptools not installed: h11 only
    _BASE = H11Protocol

if TYPE_CHECKING:  # the members the mixin uses, which both uvicorn protocols have (loop, transport, cycle)
    _Mixin = H11Protocol
else:
    _Mixin = object

DEFAULT_HEADER_TIMEOUT_S = 10.0


class _HeaderDeadline(_Mixin):
    """Mixin over a uvicorn HTTP protocol: close connections whose request headers are late."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None

    # asyncio's stubs type this BaseTransport, but a stream protocol is always handed a Transport
    # (uvicorn's own protocols override it the same way)
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        waiting_for = getattr(self, "cycle", None)   # a new request replaces the cycle once its headers are in
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._late, waiting_for)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _late(self, waiting_for: Any) -> None:
        self._header_timer = None
        if getattr(self, "cycle", None) is waiting_for and not self.transport.is_closing():
            self.transport.close()


def protocol_class(header_timeout_s: float) -> type:
    """The uvicorn `http=` protocol: httptools when installed (uvicorn's own preference), else h11."""
    return type(f"HeaderDeadline{_BASE.__name__}", (_HeaderDeadline, _BASE), {"header_timeout_s": header_timeout_s})
