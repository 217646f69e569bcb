"""The watchdog: the loop over the node's jobs (``loop``) and its detectors, hangs (``hang``), stragglers
(``straggler``) and the culprit of a hang (``culprit``).

Detectors are pure and clock-injected; the loop acts only through ``WatchdogActions`` (the node provides
them). It imports ``telemetry`` (snapshots and intervals), ``incidents`` and ``common``.
"""

from trainwarden.agent.watchdog.interface import WatchdogActions, WatchdogConfig
from trainwarden.agent.watchdog.loop import Watchdog

__all__ = ["Watchdog", "WatchdogActions", "WatchdogConfig"]
