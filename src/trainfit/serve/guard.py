"""Who may ask the server: requests made by its own page, sent to a name of this machine.

A web page the user opens elsewhere can make the browser send requests to a server on localhost: a
form post (no preflight), or a name of its own that it re-points at 127.0.0.1 (DNS rebinding). So
every request is refused with HTTP 403 unless
- its Host header is a loopback name (localhost, 127.0.0.1, ::1), the `--host` value, or, on a
  server bound to every address, an IP address or this machine's own name (a rebinding page's
  requests carry its own domain name);
- its Origin, when the browser sends one, is the page's own: http:// and the Host;
- it is not a browser's cross-site request for an answer (Sec-Fetch-Site: cross-site or same-site;
  the page itself may be opened from a link);
- a POST body is JSON: the content types a cross-site form may send without asking first
  (form-encoded, multipart, text/plain) get 403, any other non-JSON one 415.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
"""What a page of another site can POST without a CORS preflight."""
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine only."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """The name of a Host header, without its port, lower case ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class Guard:
    bind: str
    """The address the server listens on (`--host`)."""
    names: frozenset[str]
    """Host names it answers besides loopback names and IP addresses where those are allowed."""

    @classmethod
    def of(cls, bind: str) -> Guard:
        names = {bind.strip("[]").lower()}
        if bind in WILDCARDS:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(bind, frozenset(names))

    def host_allowed(self, header: str | None) -> bool:
        if not header:
            return False
        name = host_name(header)
        if is_loopback(name) or name in self.names:
            return True
        return self.bind in WILDCARDS and _is_ip(name)

    def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[HTTPStatus, str] | None:
        """(status, why) for a request this server does not answer, or None."""
        host = headers.get("Host")
        if not self.host_allowed(host):
            return HTTPStatus.FORBIDDEN, (f"Host {str(host)[:80]!r}: this server answers only requests sent to "
                                          f"this machine's own names (localhost, or --host {self.bind}); open the URL "
                                          "it printed")
        origin = headers.get("Origin")
        if origin is not None and origin.strip().lower() != f"http://{str(host).strip().lower()}":
            return HTTPStatus.FORBIDDEN, (f"Origin {origin[:80]!r}: only the server's own page may ask it; open the "
                                          "URL it printed")
        site = (headers.get("Sec-Fetch-Site") or "").lower()
        if path.startswith("/api/") and site in ("cross-site", "same-site"):
            return HTTPStatus.FORBIDDEN, "a request from another site's page; only the server's own page may ask it"
        if method == "POST":
            kind = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if kind in FORM_TYPES:
                return HTTPStatus.FORBIDDEN, (f"Content-Type {kind!r}: a form's body, which any page can send; the "
                                              "server takes JSON (Content-Type: application/json)")
            if kind != "application/json":
                return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, (f"Content-Type {kind[:80]!r}: the server takes JSON "
                                                           "(Content-Type: application/json)")
        return None
