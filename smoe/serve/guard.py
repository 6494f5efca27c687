"""Who may talk to the server: the API key (compared in constant time), and the Host and
Origin a request says it is for, so a web page in the user's browser cannot drive a local
server (cross-site requests and DNS rebinding).

- Host: on a loopback bind, a request must name a loopback host (``localhost``,
  ``127.0.0.1``, ``::1``) or one of ``--allow-host``: a page that rebinds its own name to
  127.0.0.1 still sends its own name, and is refused. On any other bind the Host is not
  checked (the machine's names are not known here).
- Origin: a request with an Origin header (browsers send one on cross-site requests) is
  refused unless that origin's host is one the server answers to (a loopback name on a
  loopback bind, else the request's own Host) or it is one of ``--allow-origin`` (``*``
  lets every origin in). Clients that are not browsers send no Origin and are not affected.

Pure functions of the request's headers and the server's settings (no aiohttp), so the
rules are tested alone.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from smoe.errors import SmoeError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
API_KEY_ENV = "SMOE_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine's loopback."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a Host header or an origin's netloc, without port or brackets, lowered."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1 : value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


@dataclass(frozen=True)
class Guard:
    """The server's access rules (see the module docstring)."""

    loopback_only: bool  # bound to loopback: the Host must be a loopback name
    allowed_hosts: frozenset[str] = frozenset()  # --allow-host (lowered names; "*": any)
    allowed_origins: frozenset[str] = frozenset()  # --allow-origin (as sent; "*": any)

    @classmethod
    def for_bind(
        cls, host: str, allow_hosts: list[str] | None = None, allow_origins: list[str] | None = None
    ) -> Guard:
        return cls(
            is_loopback(host),
            frozenset(h.strip().lower() for h in allow_hosts or []),
            frozenset(o.strip().rstrip("/") for o in allow_origins or []),
        )

    def _host_ok(self, name: str) -> bool:
        return "*" in self.allowed_hosts or name in self.allowed_hosts or is_loopback(name)

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these Host and Origin headers is refused, or None."""
        name = host_name(host or "")
        if self.loopback_only and not self._host_ok(name):
            return (
                f"this server answers to loopback names only, not Host {name!r}; start it "
                f"with --allow-host {name or 'NAME'} to let that name in"
            )
        if origin is None or "*" in self.allowed_origins:
            return None
        origin = origin.strip().rstrip("/")
        if origin in self.allowed_origins:
            return None
        origin_host = host_name(urlsplit(origin).netloc) if origin != "null" else ""
        same = origin_host and (
            self._host_ok(origin_host) if self.loopback_only else origin_host == name
        )
        if same:
            return None
        return (
            f"requests from the web page at {origin!r} are refused (another site could drive "
            f"this server from a browser); start it with --allow-origin {origin} to let it in"
        )


def key_matches(key: str, sent: str) -> bool:
    """Whether ``sent`` is ``key``, compared as bytes in time that does not depend on where
    they differ. A header's bytes that are not UTF-8 (aiohttp keeps them as surrogate
    escapes) are compared as sent; anything that cannot be compared does not match."""
    try:
        return hmac.compare_digest(key.encode(), sent.encode("utf-8", "surrogateescape"))
    except Exception:  # (a header is a str; this is the last line of defence)
        return False


def sent_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request sends: a Bearer token (OpenAI's and Ollama's clients; the scheme
    in any case, RFC 7235), else ``x-api-key`` (Anthropic's), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return x_api_key


def resolve_api_key(flag: str | None, key_file: Path | None) -> str | None:
    """The API key from --api-key, else --api-key-file's first line, else $SMOE_API_KEY,
    else None (no key asked). An empty or blank key from any of them is a SmoeError
    (it would ask no key at all), as is a file that cannot be read."""
    if flag is not None:
        key, where = flag, "--api-key"
    elif key_file is not None:
        try:
            text = key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or type(e).__name__
            raise SmoeError(
                f"cannot read --api-key-file {key_file} ({reason}); give a readable UTF-8 "
                "file whose first line is the key"
            ) from None
        lines = text.splitlines()
        key, where = (lines[0] if lines else ""), f"--api-key-file {key_file}"
    elif API_KEY_ENV in os.environ:
        key, where = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    key = key.strip()
    if not key:
        raise SmoeError(f"{where} is empty, which would ask no key at all; give a key or drop it")
    return key
