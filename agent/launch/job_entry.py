"""How ``trainwarden run`` (agent/launch/run.py) enters its job in etcd as this node (agent/etcd/membership.py):
refused while another live run holds the node; the first node of a (new) generation records the spec and resets the
rendezvous (taking over a job whose runs are gone), the others join the generation it started. Each node then keeps
a membership record, which the other nodes and fencing (fencing.py) read.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Callable, TextIO

from trainwarden.agent.common import exit_codes
from trainwarden.agent.common.job_lifecycle import JobPhase, JobRecord
from trainwarden.agent.etcd.client import describe_etcd_error
from trainwarden.agent.etcd.membership import NodeMembership, NodeTaken, admit
from trainwarden.agent.launch.run_options import RunOptions
from trainwarden.agent.launch.services import Abandon, EtcdSession

__all__ = ["enter_job"]

logger = logging.getLogger("trainwarden.agent.launch.run")  # the run's log


def enter_job(opts: RunOptions, *, etcd: EtcdSession, node: str, record: JobRecord, spec: dict, address: str | None,
              out: TextIO, serve_probe: Callable[[dict], None], cleanup: ExitStack) -> NodeMembership:
    """Enter ``opts.job`` as ``node`` and start its membership record (module docstring); ``record``'s generation
    is the one this node runs; ``spec``: what the first node records for a job that is not submitted;
    ``serve_probe``: adds the link probe's address to the membership record (links.py)."""
    try:
        admission, release = admit(etcd.client, opts.job, node)
    except NodeTaken as exc:
        raise Abandon(exit_codes.EXIT_USAGE, str(exc)) from None
    except Exception as exc:  # TimeoutError, or etcd gone since connect()
        raise Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, f"cannot enter job {opts.job} in etcd at "
                      f"{etcd.endpoint}: {describe_etcd_error(exc)}") from None
    try:
        previous = etcd.records.get_state(opts.job)
        if admission.starts_job:
            if not opts.managed:  # a submitted job's spec is the operator's (agent/etcd/jobs.py)
                etcd.records.put_spec(opts.job, spec)
            if previous is not None:
                _take_over(opts, etcd, record, previous)
        else:
            record.generation = int((previous or {}).get("generation", 0))
            print(f"trainwarden: node {node} joins job {opts.job} (generation {record.generation}) "
                  f"beside {', '.join(sorted(admission.peers))}", file=out, flush=True)
        mine = {"owner": record.owner, "address": address or "", "nproc_per_node": opts.nproc_per_node,
                "generation": record.generation, "phase": JobPhase.STARTING.value}
        serve_probe(mine)
        membership = NodeMembership(etcd.client, opts.job, node, mine)
        membership.start()
        cleanup.callback(membership.stop)
        return membership
    except Exception as exc:
        raise Abandon(exit_codes.EXIT_ETCD_UNAVAILABLE, f"cannot enter job {opts.job} in etcd at "
                      f"{etcd.endpoint}: {describe_etcd_error(exc)}") from None
    finally:
        release()


def _take_over(opts: RunOptions, etcd: EtcdSession, record: JobRecord, previous: dict) -> None:
    """A job already in etcd and no node of it live: continue it with the next generation, or with the one
    `submit`/`resume` wrote in ``pending`` for the daemons to start. A non-terminal phase was left by runs
    that are gone (killed hard, or cut off from etcd for longer than their record's lease: those stop
    their workers themselves)."""
    phase = previous.get("phase")
    if phase not in [p.value for p in JobPhase if p.terminal] + [JobPhase.PENDING.value]:
        logger.warning("job %s was left %s by a trainwarden run that is gone (%s); taking over",
                       opts.job, phase, previous.get("owner"))
    fresh = phase == JobPhase.PENDING.value and opts.managed  # the generation the operator's request made
    record.generation = int(previous.get("generation", 0)) + (0 if fresh else 1)
    etcd.records.reset_rendezvous(opts.job)
