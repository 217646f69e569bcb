"""Launches of daemon-run jobs as another user, back to back and a few at once: does any die of fork? (issue 45)

A real root `trainwarden agent` (loopback etcd, embedded) runs every job as ``nobody``; each job is a one-rank
`trainwarden run` of a script that prints a line. A launch is *aborted* when its launcher ends by a signal nobody
sent (the daemon logs "exited with -N") or its log holds gRPC's fatal check (``Check failed``, ``ev_epoll``): what
a fork of the daemon's gRPC threads looked like before the identity was switched after exec.

    python tests/bench/launch_stress.py --launches 200 --at-once 3

Ends with ``launch stress: N launches, A aborted`` and exits 1 when A > 0. ``--keep DIR`` keeps the logs there.
Needs root (a second user) and the etcd binary of the test extra.

``--warm-restarts N`` is the other half: one `trainwarden run` whose warm workers torchrun restarts N times
(tests/bench/warm_restarts.py); it ends with ``warm restarts: N restarts, A aborted``.

    python tests/bench/launch_stress.py --warm-restarts 200 [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "integration")]

import warm_restarts  # noqa: E402
from job_users import NOBODY, interpreter_for_others, shared_dir, unavailable  # noqa: E402
from procs import ProcessGroup  # noqa: E402
from test_daemon_jobs import Daemons, _cli, _jobs  # noqa: E402

ABORT = warm_restarts.FATAL
SIGNALLED = re.compile(r"job (\S+) generation \d+: the launcher on node \S+ exited with (-\d+)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=30, help="jobs to launch in all (default 30)")
    parser.add_argument("--at-once", type=int, default=3, help="jobs running at the same time (default 3)")
    parser.add_argument("--keep", type=Path, help="copy the daemon's and the jobs' logs here")
    parser.add_argument("--warm-restarts", type=int, metavar="N",
                        help="instead: one `trainwarden run` whose warm workers crash and are restarted N times")
    parser.add_argument("--nproc", type=int, default=2, help="with --warm-restarts: ranks (default 2)")
    parser.add_argument("--crash", choices=("exit", "kill"), default="exit",
                        help="with --warm-restarts: how the planned crash ends its rank (default exit: an exit code)")
    parser.add_argument("--timeout", type=float, help="with --warm-restarts: seconds before the run is stopped (and "
                        "its unreached rounds count as aborted; default 120 + 30 per restart)")
    args = parser.parse_args(argv)
    if args.warm_restarts is not None:
        if args.warm_restarts < 1:
            parser.error("--warm-restarts must be at least 1")
        return warm_restarts.main(args.warm_restarts, args.nproc, args.keep, args.crash, args.timeout)
    if unavailable():
        sys.exit(f"launch_stress: {unavailable()}")
    from trainwarden.agent.etcd.embedded import EmbeddedEtcd

    shared = shared_dir("tw-launch-stress-")
    procs = ProcessGroup()
    etcd = EmbeddedEtcd()
    started = time.monotonic()
    try:
        etcd.start()
        daemons = Daemons(procs, shared, etcd.endpoint)
        daemons.start("n0", users=("--job-user", NOBODY), wrap=tuple(interpreter_for_others()))
        script = shared / "hello.py"
        script.write_text("print('hello from a stress job', flush=True)\n")
        os.chmod(script, 0o644)
        done, submitted, running = {}, 0, set()
        while len(done) < args.launches:
            while submitted < args.launches and len(running) < args.at_once:
                name = f"ls{submitted:04d}"
                spec = shared / f"{name}.toml"
                spec.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in {
                    "name": name, "nnodes": "1", "nproc_per_node": 1, "max_restarts": 0,
                    "command": [str(script)]}.items()) + "\n")
                out = _cli("submit", str(spec), etcd=etcd.endpoint)
                if out.returncode != 0:
                    sys.exit(f"launch_stress: submit {name} failed: {out.stderr}")
                running.add(name)
                submitted += 1
            time.sleep(2)
            phases = _jobs(etcd.endpoint)
            for name in list(running):
                phase = phases.get(name, {}).get("phase")
                if phase in ("succeeded", "failed", "refused"):
                    running.discard(name)
                    done[name] = phase
            print(f"\rlaunch stress: {len(done)}/{args.launches} finished, {time.monotonic() - started:.0f}s",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        log = daemons.log("n0")
        aborted = {job for job, _rc in SIGNALLED.findall(log)}
        aborted |= {name for name in done if ABORT.search(daemons.job_log("n0", name))}
        failed = sorted(name for name, phase in done.items() if phase != "succeeded")
        launches = sum(daemons.job_log("n0", name).count(" starts job ") for name in done)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copytree(shared / "n0", args.keep / "n0", dirs_exist_ok=True, symlinks=True,
                            ignore=shutil.ignore_patterns("*.sock", "*.sock.cred"))
        print(f"jobs not succeeded: {failed[:20]}" if failed else "every job succeeded")
        if aborted:
            print(f"aborted launches: {sorted(aborted)[:20]}")
        print(f"launch stress: {launches} launches in {time.monotonic() - started:.0f}s, {len(aborted)} aborted")
        return 1 if aborted or failed else 0
    finally:
        daemons_close = locals().get("daemons")
        if daemons_close is not None:
            daemons_close.close()
        procs.close()
        etcd.stop()
        shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
