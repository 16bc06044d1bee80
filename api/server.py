"""uvicorn, answering what it refuses itself with the one error body.

uvicorn's h11 protocol answers a request it cannot parse (malformed request line or header, a head larger
than h11's buffer, a non-ASCII target) with a plain-text 400, or with nothing at all for a non-ASCII target
(the exception escapes ``data_received`` and the connection is dropped). ``JsonErrorsH11Protocol`` keeps
uvicorn's parsing and answers those with ``{"error": {...}}`` and the right status: 431 for a head over the
buffer, 414 when the request line alone does not fit, 400 otherwise. Pass it as ``http=`` to
``uvicorn.Config`` / ``uvicorn.run`` (``server_options()`` does).
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.limits import MAX_HEADER_BYTES, MAX_URL_BYTES, error_bytes
from api.request_log import new_request_id

__all__ = ["JsonErrorsH11Protocol", "server_options"]

#: h11 holds at most this much of an incomplete request head: the app's own URL and header limits fit in it.
HEAD_BUFFER_BYTES = MAX_URL_BYTES + MAX_HEADER_BYTES + 1024


class JsonErrorsH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error_status = 400
        self._wrap_next_event()

    def _wrap_next_event(self) -> None:
        conn, original = self.conn, self.conn.next_event

        def next_event():
            try:
                return original()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint or 400
                if self._error_status == 431 and b"\r\n" not in bytes(getattr(conn, "_receive_buffer", b"\r\n")):
                    self._error_status = 414  # the request line alone overflowed the buffer
                raise

        conn.next_event = next_event

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except UnicodeDecodeError:  # uvicorn decodes the target as ASCII
            self.logger.warning("Invalid HTTP request received: a non-ASCII request target.")
            self._error_status = 400
            self.send_400_response("the request target must be ASCII (percent-encode other bytes)")

    def send_400_response(self, msg: str) -> None:
        status = self._error_status if self._error_status in (400, 414, 431, 501) else 400
        messages = {
            400: "the HTTP request is malformed",
            414: "the request line is too long",
            431: "the request head (line and headers) is too large",
            501: "this transfer encoding is not supported",
        }
        request_id = new_request_id()  # the app never saw this request: its id is made here
        body = error_bytes(status, messages[status], request_id=request_id)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), (b"x-request-id", request_id.encode())]
        try:
            reason = {400: b"Bad Request", 414: b"URI Too Long", 431: b"Request Header Fields Too Large",
                      501: b"Not Implemented"}[status]
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a response had already started: nothing valid can be sent
            pass
        self.transport.close()


def server_options() -> dict[str, Any]:
    """uvicorn options every way of serving Memex uses."""
    # proxy_headers=False: uvicorn would otherwise believe X-Forwarded-For from any loopback peer (its default
    # forwarded_allow_ips); Memex reads it itself, from MEMEX_TRUSTED_PROXIES only (tenancy/addresses.py).
    return {"http": JsonErrorsH11Protocol, "h11_max_incomplete_event_size": HEAD_BUFFER_BYTES, "proxy_headers": False}
