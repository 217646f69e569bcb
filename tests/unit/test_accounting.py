"""What a ``trainwarden run`` counts for its job (agent/launch/accounting.py ``Accounting``), alone, with fakes for
the agent and the GPU: the history it starts, the MFU gauge it registers (or says why not), the incidents it counts."""

from __future__ import annotations

import io
import os
from contextlib import ExitStack
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from trainwarden.agent.common.job_history import read_history
from trainwarden.agent.incidents.record import Incident, IncidentKind, IncidentState
from trainwarden.agent.launch.accounting import Accounting


def _agent(p50_s: float = 0.5):
    """A node agent as accounting reads it: its registry and one job snapshot (2 ranks of a 2-rank world)."""
    snapshot = [SimpleNamespace(world_size=2, ranks=[SimpleNamespace(step_p50_seconds=p50_s, tokens_per_second=0.0)]
                                * 2)]
    return SimpleNamespace(registry=CollectorRegistry(), job_telemetry=SimpleNamespace(snapshot=lambda job: snapshot))


def _accounting(tmp_path, peak=None) -> tuple[Accounting, io.StringIO]:
    out = io.StringIO()
    return Accounting(job="j", node="n1", state_dir=tmp_path, out=out, detect_peak=lambda: peak), out


def test_the_history_starts_with_the_launch_and_is_closed_with_the_run(tmp_path):
    accounting, _ = _accounting(tmp_path)
    with ExitStack() as cleanup:
        accounting.start_history(cleanup, nnodes="1:2", nproc_per_node=4)
    events = read_history(tmp_path / "history").events
    assert [(e["event"], e["node"], e["pid"], e["nnodes"], e["nproc_per_node"]) for e in events] == [
        ("launched", "n1", os.getpid(), "1:2", 4)]


def test_no_step_cost_no_mfu_gauge(tmp_path):
    accounting, out = _accounting(tmp_path)
    agent = _agent()
    accounting.register_mfu(agent, flops_per_step=0.0, model_params=0.0, peak_tflops=0.0)
    assert accounting.mfu is None and accounting.mfu_line() is None and out.getvalue() == ""


def test_an_unknown_peak_is_said_not_guessed(tmp_path):
    accounting, out = _accounting(tmp_path, peak=None)
    accounting.register_mfu(_agent(), flops_per_step=1e15, model_params=0.0, peak_tflops=0.0)
    assert accounting.mfu is None and "no MFU: the accelerator's peak is unknown" in out.getvalue()


def test_the_mfu_gauge_is_registered_and_the_summary_says_where_its_peak_came_from(tmp_path):
    accounting, _ = _accounting(tmp_path, peak=(1000.0, "NVIDIA H100 80GB HBM3"))
    agent = _agent(p50_s=0.5)
    accounting.register_mfu(agent, flops_per_step=1e15, model_params=0.0, peak_tflops=0.0)
    assert accounting.mfu is not None and agent.registry.get_sample_value(
        "trainwarden_mfu_ratio", {"job": "j", "node": "n1"}) == 1e15 / 0.5 / 2 / 1e15
    assert accounting.mfu_line() == "100.0% (--flops-per-step, 1000 TFLOPS per accelerator (NVIDIA H100 80GB HBM3))"
    given, _ = _accounting(tmp_path, peak=None)  # --peak-tflops: nothing detected
    given.register_mfu(_agent(), flops_per_step=0.0, model_params=1e6, peak_tflops=50.0)
    assert given.mfu is not None and given._mfu_basis == "6 x --model-params x tokens, 50 TFLOPS per accelerator " \
                                                         "(--peak-tflops)"


def test_only_this_jobs_incidents_reach_its_goodput_ledger(tmp_path):
    accounting, _ = _accounting(tmp_path)
    seen = []
    accounting.goodput = SimpleNamespace(incident=lambda *args: seen.append(args))
    for job in ("other", "j"):
        accounting.on_incident(Incident(id=f"{job}-1", kind=IncidentKind.STRAGGLER_START, job=job, node="n1",
                                        state=IncidentState.OPEN))
    assert seen == [("straggler_start", "open", "j-1")]
