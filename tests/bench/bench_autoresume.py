"""Failure -> first completed step after an alert-driven resume, with its parts, beside the same resume made by
hand the instant the failure is seen (the baseline: an operator who never sleeps).

    python tests/bench/bench_autoresume.py --runs 3

Each run: a real etcd, a `trainwarden agent` daemon with the Alertmanager webhook, real Prometheus (scrape and
rule evaluation every 1 s) with dashboards/prometheus/alerts.yml, real Alertmanager with deploy/alertmanager.yml
(group_wait 5 s), and a 2-rank reference GPT job (max_restarts 0) that crashes at step 14 with a checkpoint
every 5 steps. Parts of the alert path:

* rule: the failed phase written to etcd -> the alert's startsAt (daemon reconcile up to 2 s, scrape, rule);
* alertmanager: startsAt -> the webhook's request arriving (group_wait, delivery);
* webhook: the request -> the new generation written (checks, one etcd transaction);
* resume: the new generation -> the first completed step (daemon reconcile, launcher, torchrun, restore).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alerting import AlertingBed, alertmanager_binary, run_failed_job  # noqa: E402
from procs import ProcessGroup  # noqa: E402
from trainwarden.agent.etcd.embedded import EmbeddedEtcd  # noqa: E402


def one(tmp: Path, index: int, *, alert: bool) -> dict[str, float]:
    etcd = EmbeddedEtcd(data_dir=tmp / "etcd", log_path=tmp / "etcd.log")
    etcd.start()
    procs = ProcessGroup()
    bed = AlertingBed(procs, tmp, etcd.endpoint)
    try:
        bed.start_daemon()
        if alert:
            bed.start_prometheus()
            bed.start_alertmanager()
        return run_failed_job(bed, f"bench{index}", resume_directly=not alert)
    finally:
        bed.close()
        procs.close()
        etcd.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each (default 3)")
    args = parser.parse_args()
    if alertmanager_binary() is None:
        print("prometheus-alertmanager is not installed (apt-get install prometheus prometheus-alertmanager)")
        return 2
    results: dict[str, list[dict[str, float]]] = {"alert": [], "by hand": []}
    for i in range(args.runs):
        for mode in ("alert", "by hand"):
            with tempfile.TemporaryDirectory(prefix="tw-bench-autoresume-") as tmp:
                r = one(Path(tmp), i, alert=mode == "alert")
            results[mode].append(r)
            print(f"run {i + 1} {mode:8s}: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.items() if k != "failed"),
                  flush=True)
    print("\nmedians (s):")
    for mode, runs in results.items():
        keys = [k for k in runs[0] if k != "failed"]
        print(f"  {mode:8s}: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.1f}" for k in keys))
    alert = statistics.median(r["total"] for r in results["alert"])
    hand = statistics.median(r["total"] for r in results["by hand"])
    print(f"\nfailure -> first step: alert-driven {alert:.1f} s, resumed by hand at once {hand:.1f} s "
          f"(ratio {alert / hand:.2f}x; the alert path adds {alert - hand:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
