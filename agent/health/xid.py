"""XID critical-error events from NVML, counted per (gpu, xid) by a listener thread.

An XID is the driver's report of a GPU error (XID 79: the GPU fell off the bus; 48: a double-bit ECC
error). NVML delivers them through an event set: ``nvmlEventSetCreate``, then
``nvmlDeviceRegisterEvents(handle, nvmlEventTypeXidCriticalError, set)`` per GPU, then
``nvmlEventSetWait_v2(set, timeout_ms)`` returns one event (``eventData`` is the XID) or raises
``NVMLError`` with ``NVML_ERROR_TIMEOUT``. The wait runs on its own daemon thread with a timeout so that
``stop()`` returns within about one timeout; the event set is freed only after the thread has ended.

GPUs that cannot register (``NotSupported`` on some boards, or without root) are logged and skipped; with
none registered the listener reports itself unavailable. The ``xid`` label is capped at ``max_series``
distinct (gpu, xid) pairs, later pairs count under ``xid="other"``, so a flood of odd codes cannot blow up
the series count.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

logger = logging.getLogger(__name__)

__all__ = ["XID_DESCRIPTIONS", "XidListener"]

XID_EVENT_TYPE = 0x8  # nvmlEventTypeXidCriticalError, for NVML modules that lack the constant

#: Short names of the XIDs that need a GPU reset or a technician (NVIDIA's XID catalog).
XID_DESCRIPTIONS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class XidListener:
    """Waits for XID events on every given GPU and counts them per (gpu index, xid)."""

    def __init__(
        self,
        nvml: Any,
        gpus: Sequence[tuple[int, Any, str]],
        *,
        wait_s: float = 1.0,
        max_series: int = 64,
    ) -> None:
        """``gpus`` holds (index, NVML handle, uuid) for each GPU to listen on."""
        self._nvml = nvml
        self._gpus = list(gpus)
        self._wait_ms = max(1, int(wait_s * 1000))
        self._wait_s = wait_s
        self._max_series = max_series
        self._event_type = getattr(nvml, "nvmlEventTypeXidCriticalError", XID_EVENT_TYPE)
        self._event_set: Any = None
        self._registered = 0
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        """True while the listener thread runs with at least one GPU registered."""
        return self._thread is not None and self._thread.is_alive() and self._registered > 0

    @property
    def ended(self) -> bool:
        """True when the listener thread was started and is no longer running."""
        return self._thread is not None and not self._thread.is_alive()

    def counts(self) -> dict[tuple[str, str], int]:
        """XID events seen so far, keyed by (gpu label, xid label)."""
        with self._lock:
            return dict(self._counts)

    def start(self) -> bool:
        """Create the event set, register every GPU and start the thread. Returns ``available``."""
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as err:
            logger.warning("XID monitoring unavailable: nvmlEventSetCreate failed: %s", err)
            return False
        for index, handle, _uuid in self._gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, self._event_type, self._event_set)
                self._registered += 1
            except nvml.NVMLError as err:
                logger.warning("GPU %d: XID events unavailable (%s); its XIDs will not be counted", index, err)
        if not self._registered:
            self._free()
            return False
        self._thread = threading.Thread(target=self._run, name="trainwarden-gpu-xid", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float) -> bool:
        """Stop and join the thread, then free the event set. False if the thread did not end in time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("GPU XID listener did not stop within %.1fs; leaving its event set", timeout_s)
                return False
        self._free()
        return True

    def _free(self) -> None:
        if self._event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except Exception as err:  # cleanup: report, never raise
            logger.warning("nvmlEventSetFree failed: %s", err)
        self._event_set = None

    def _run(self) -> None:
        nvml = self._nvml
        timeout_code = getattr(nvml, "NVML_ERROR_TIMEOUT", 10)
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while not self._stop.is_set():
            try:
                self.record(wait(self._event_set, self._wait_ms))
            except nvml.NVMLError as err:
                if getattr(err, "value", None) == timeout_code:
                    continue
                logger.warning("waiting for GPU XID events failed: %s; retrying", err)
                self._stop.wait(self._wait_s)
            except Exception:  # one bad event must not end the listener
                logger.exception("GPU XID listener: could not handle an event; continuing")
                self._stop.wait(self._wait_s)

    def record(self, event: Any) -> None:
        """Count one NVML event (``eventType``, ``eventData`` = XID, ``device``); others are ignored."""
        if not int(event.eventType) & self._event_type:
            return
        xid, gpu = int(event.eventData), self._gpu_label(event.device)
        logger.error("GPU %s reported XID %d (%s)", gpu, xid, XID_DESCRIPTIONS.get(xid, "see NVIDIA's XID catalog"))
        with self._lock:
            key = (gpu, str(xid))
            if key not in self._counts and len(self._counts) >= self._max_series:
                key = (gpu, "other")
            self._counts[key] = self._counts.get(key, 0) + 1

    def _gpu_label(self, device: Any) -> str:
        """The index of the GPU an event came from (asked of NVML, else matched by UUID), or ``unknown``."""
        try:
            return str(int(self._nvml.nvmlDeviceGetIndex(device)))
        except Exception:
            pass
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(device))
            return next(str(index) for index, _handle, gpu_uuid in self._gpus if gpu_uuid == uuid)
        except Exception:
            return "unknown"
