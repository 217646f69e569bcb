"""What the node daemon fetches of a job's launcher: ``http://127.0.0.1:<port>/metrics`` and nothing else, bounded.

Design
------
The daemon runs as root; the URL of a launcher's endpoint is in the job's state directory
(``agent.metrics.url``), which the job's user owns and writes. So the record is a claim of that user, and the
daemon treats it as one (docs/SECURITY.md, "What the daemon fetches for a job"):

- ``read_record`` opens the record with ``O_NOFOLLOW|O_NONBLOCK`` under a directory opened the same way: a link,
  a FIFO or a device is refused (never followed, never blocked on), and so is a file over ``MAX_RECORD_BYTES``.
- ``launcher_target`` accepts exactly ``http://127.0.0.1:<port>/metrics`` or ``http://[::1]:<port>/metrics`` with
  ``1 <= port <= 65535``; anything else (another scheme such as ``file:``, another host, a path, a query, user
  info) is refused with what was wrong. The relay logs a refusal once per job and skips the job.
- ``fetch_metrics`` is a raw HTTP/1.0 GET on its own socket, no library that follows redirects or proxies:
  connect and each read wait ``timeout_s`` at most, the whole fetch ``deadline_s``, the body ``max_bytes``. A
  target that never answers, dribbles or streams forever costs one scrape that bound and no thread outlives it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import time
from urllib.parse import urlsplit

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MAX_RECORD_BYTES", "TargetRefused", "fetch_metrics", "launcher_target",
           "read_record"]

MAX_RECORD_BYTES = 256
"""A launcher's record is one URL; anything longer is not one."""
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Bytes of one launcher's exposition the daemon reads at most (a launcher's job series are a few hundred KiB)."""
_MAX_HEADER_BYTES = 64 * 1024
_TARGET = re.compile(r"http://(127\.0\.0\.1|\[::1\]):([0-9]{1,5})/metrics")
_LOOPBACK = {"127.0.0.1": "127.0.0.1", "[::1]": "::1"}


class TargetRefused(ValueError):
    """A job's recorded metrics target the daemon will not fetch; the message says what is wrong. Not retried:
    the job's launcher must record an allowed URL."""


def read_record(directory: str | os.PathLike, name: str) -> str | None:
    """The text of ``directory/name`` (a file a job's user may write), or None when there is none. Neither the
    directory nor the file is followed if it is a link; ``TargetRefused`` for anything but a small regular file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        dir_fd = os.open(directory, flags | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TargetRefused(f"its state directory {directory} cannot be opened without following a link "
                            f"({exc.strerror})") from None
    try:
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise TargetRefused(f"{name} cannot be read safely ({why})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TargetRefused(f"{name} is not a regular file")
            if st.st_size > MAX_RECORD_BYTES:
                raise TargetRefused(f"{name} holds {st.st_size} bytes, more than the {MAX_RECORD_BYTES} of a URL")
            data = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    if len(data) > MAX_RECORD_BYTES:
        raise TargetRefused(f"{name} holds more than the {MAX_RECORD_BYTES} bytes of a URL")
    return data.decode("utf-8", errors="replace").strip()


def launcher_target(url: str) -> tuple[str, int]:
    """``(host, port)`` of a launcher's metrics URL; ``TargetRefused`` saying what is wrong with anything other
    than ``http://127.0.0.1:<port>/metrics`` or ``http://[::1]:<port>/metrics``."""
    shown = repr(url[:80])
    match = _TARGET.fullmatch(url)
    if match is None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise TargetRefused(f"{shown} is not a URL") from None
        if parts.scheme != "http":
            why = f"its scheme is {parts.scheme or 'missing'!r}, not 'http'"
        elif parts.username is not None or parts.password is not None:
            why = "it carries user information"
        elif parts.hostname not in ("127.0.0.1", "::1"):
            why = f"its host {parts.hostname!r} is not loopback (127.0.0.1 or [::1])"
        elif port is None:
            why = "it names no port"
        elif parts.path != "/metrics" or parts.query or parts.fragment:
            why = "its path is not /metrics (with no query)"
        else:
            why = "it is not in the form http://127.0.0.1:PORT/metrics"
        raise TargetRefused(f"{shown}: {why}; only http://127.0.0.1:PORT/metrics or http://[::1]:PORT/metrics "
                            "is fetched")
    port = int(match.group(2))
    if not 1 <= port <= 65535:
        raise TargetRefused(f"{shown}: port {port} is not 1..65535")
    return _LOOPBACK[match.group(1)], port


def fetch_metrics(url: str, timeout_s: float, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  deadline_s: float | None = None, clock=time.monotonic) -> str:
    """The body of a launcher's ``/metrics`` (module docstring); ``TargetRefused`` for a URL not allowed,
    ``OSError`` (``TimeoutError`` past the bounds) or ``ValueError`` (not a 200, too big) otherwise."""
    host, port = launcher_target(url)
    deadline = clock() + (deadline_s if deadline_s is not None else 2 * timeout_s)

    def wait() -> float:
        left = deadline - clock()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {deadline_s if deadline_s is not None else 2 * timeout_s:g} s")
        return min(timeout_s, left)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait())
        sock.connect((host, port))
        shown_host = f"[{host}]" if ":" in host else host
        sock.sendall(f"GET /metrics HTTP/1.0\r\nHost: {shown_host}:{port}\r\nAccept: text/plain\r\n"
                     "Connection: close\r\n\r\n".encode("ascii"))
        limit = _MAX_HEADER_BYTES + max_bytes
        received = bytearray()
        while True:
            sock.settimeout(wait())
            chunk = sock.recv(min(65536, limit + 1 - len(received)))
            if not chunk:
                break
            received += chunk
            if len(received) > limit:
                raise ValueError(f"the answer exceeds {max_bytes} bytes; left out")
    head, sep, body = bytes(received).partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("the answer has no HTTP header")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/") or status[1] != "200":
        raise ValueError(f"the answer is {lines[0][:80]!r}, not 200")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "identity").lower() != "identity" or \
            headers.get("content-encoding", "identity").lower() != "identity":
        raise ValueError("the answer is encoded (chunked or compressed); an HTTP/1.0 plain body was asked for")
    if len(body) > max_bytes:
        raise ValueError(f"the answer exceeds {max_bytes} bytes; left out")
    return body.decode("utf-8")
