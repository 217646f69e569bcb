"""sd_notify: telling systemd that the daemon is ready, still alive, or stopping (``Type=notify``, ``WatchdogSec=``).

The protocol (sd_notify(3)) is a unix datagram per notification, sent to the address systemd puts in
``NOTIFY_SOCKET``: a path, or a name in the abstract namespace written with a leading ``@`` (a NUL byte on
the wire). The datagram holds newline-separated ``KEY=VALUE`` lines: ``READY=1`` (start-up is complete: with
``Type=notify`` the unit is "active" only now), ``STATUS=...`` (one line that ``systemctl status`` shows),
``WATCHDOG=1`` (a keep-alive) and ``STOPPING=1``. With ``WatchdogSec=`` systemd also sets ``WATCHDOG_USEC``,
the interval within which it wants a keep-alive before it kills the service with ``WatchdogSignal=`` (SIGABRT)
and, under ``Restart=``, starts it again; and ``WATCHDOG_PID``, the process meant to send them: a process with
another pid inherited the variables and must not (``watchdog_interval``).

This client needs only the standard library (no libsystemd, no python-systemd). Without ``NOTIFY_SOCKET`` (not
started by systemd: a shell, a test, a container) every call returns at once. A send that fails (systemd
restarted, the socket's permissions) is logged once and never raised: a notification is advice to the
service manager, and the daemon's work does not depend on it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Mapping, MutableMapping

logger = logging.getLogger(__name__)

__all__ = ["NOTIFY_SOCKET_ENV", "WATCHDOG_PID_ENV", "WATCHDOG_USEC_ENV", "SdNotifier", "watchdog_interval"]

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


def watchdog_interval(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Seconds within which systemd wants a ``WATCHDOG=1`` from process ``pid`` (default: this one); None when
    it wants none: no ``WATCHDOG_USEC``, a value that is not a positive number, or ``WATCHDOG_PID`` naming
    another process (what sd_watchdog_enabled(3) decides)."""
    usec = environ.get(WATCHDOG_USEC_ENV)
    if not usec:
        return None
    owner = environ.get(WATCHDOG_PID_ENV)
    if owner:
        if not owner.isdigit():
            logger.warning("%s=%r is not a pid; sending no keep-alives", WATCHDOG_PID_ENV, owner)
            return None
        if int(owner) != (os.getpid() if pid is None else pid):
            return None  # inherited from a parent that systemd watches; not ours to keep alive
    if not usec.isdigit() or int(usec) == 0:
        logger.warning("%s=%r is not a positive number of microseconds; sending no keep-alives",
                       WATCHDOG_USEC_ENV, usec)
        return None
    return int(usec) / 1e6


class SdNotifier:
    """Sends notifications to systemd's ``NOTIFY_SOCKET``; every method is a no-op when there is none."""

    def __init__(self, address: str | None, *, watchdog_s: float | None = None) -> None:
        """``address``: ``NOTIFY_SOCKET`` as systemd writes it (``/run/systemd/notify``, ``@name``) or None.
        ``watchdog_s``: the keep-alive interval systemd asked for (``watchdog_interval``), None for none."""
        self.address = address or None
        self.watchdog_s = watchdog_s
        self._target: str | bytes | None = None
        if self.address is not None:
            if self.address.startswith("/"):
                self._target = self.address
            elif self.address.startswith("@") and len(self.address) > 1:
                self._target = b"\0" + self.address[1:].encode()
            else:  # systemd 254+ may also name a vsock address; nothing here needs it
                logger.warning("%s=%r: only a path or an @abstract name is supported; sending systemd nothing",
                               NOTIFY_SOCKET_ENV, self.address)
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._failing = False

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] = os.environ, *, pid: int | None = None,
                         unset: bool = False) -> "SdNotifier":
        """The notifier systemd set up for this process. ``unset`` removes the variables from ``environ``
        afterwards (sd_notify's ``unset_environment``): the jobs a daemon starts must not inherit them."""
        notifier = cls(environ.get(NOTIFY_SOCKET_ENV), watchdog_s=watchdog_interval(environ, pid))
        if unset:
            for name in (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV):
                environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """Whether notifications go anywhere."""
        return self._target is not None

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: the service is up. With ``WatchdogSec=`` the same datagram is the first keep-alive."""
        return self.notify("READY=1", *(["WATCHDOG=1"] if self.watchdog_s else []), *_status(status))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: one keep-alive."""
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """``STATUS=text``: the line ``systemctl status`` shows."""
        return self.notify(*_status(text))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the service is shutting down (systemd stops expecting keep-alives)."""
        return self.notify("STOPPING=1", *_status(status))

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; True when it was sent."""
        if self._target is None or not lines:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec
                self._socket.sendto(payload, self._target)
            except OSError as exc:
                if not self._failing:
                    logger.warning("cannot notify systemd at %s (%s); the daemon goes on without telling it",
                                   self.address, exc.strerror or exc)
                self._failing = True
                return False
            if self._failing:
                logger.info("notifying systemd at %s works again", self.address)
            self._failing = False
        return True

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None


def _status(text: str | None) -> list[str]:
    """A ``STATUS=`` line; a newline would end it early and start a bogus key, so it becomes a space."""
    return [] if text is None else ["STATUS=" + " ".join(text.splitlines())]
