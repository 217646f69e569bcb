"""A job over several simulated nodes (issue 10): `trainwarden run` on each node, as torchrun is run per node.

On the multi-host test bed (tests/testbed.py): three training nodes of two ranks each, a 3-member etcd
cluster on hosts of its own, checkpoints on storage the nodes share (a directory: the bed shares the
machine's file system). The reference GPT runs with tensor parallelism 2 inside each node and data
parallelism across nodes, ``--dp`` left out so that each round takes the degree its world allows.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from procs import wait_for
from testbed import TestBed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

if TestBed.unavailable():
    pytest.skip(TestBed.unavailable(), allow_module_level=True)

STEP_RE = re.compile(r"^(\S+ \S+) \[rank 0\] [\w.]+: step (\d+) loss ([\d.]+)", re.M)
RESUMED_RE = re.compile(r"^(\S+ \S+) \[rank 0\] [\w.]+: resumed from (?:checkpoint step|the memory snapshots? of step) (\d+)",
                        re.M)


def _start(bed: TestBed, tmp_path: Path, node: str, job: str, steps: int, ckpt: Path, nnodes: str = "2:3"):
    env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / node / "state"))
    log = tmp_path / node / "run.log"
    proc = bed.spawn(node, [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                            "--nnodes", nnodes, "--nproc-per-node", "2", "--node", node, "--max-restarts", "3",
                            "--job", job, "--etcd", bed.etcd_endpoints,
                            # warm workers by default: every restart forks its workers from the node's zygote,
                            # and the exact continuation checks below hold in a world that shrinks and grows
                            "--",
                            "-m", "trainwarden.runtime.examples.gpt", "--tp", "2", "--batch", "12",
                            # two sequences per micro-batch: dp 3 takes 2 micro-batches a rank, dp 2 accumulates 3
                            "--micro-batch-size", "2",
                            "--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "5"],
                     log=log, env=env)
    return proc, log


def _etcd_incidents(bed: TestBed, job: str) -> list[dict]:
    """Every version of the job's incidents in etcd, read from inside the bed (the etcd members live there)."""
    import json

    host, port = bed.etcd_endpoints.split(",")[0].split(":")
    dump = ("import etcd3, json\n"
            f"c = etcd3.client(host={host!r}, port={port})\n"
            f"for v, _ in c.get_prefix('/trainwarden/v1/jobs/{job}/incidents/'):\n"
            "    print(json.dumps(json.loads(v)))\n")
    out = bed.run("n0", [sys.executable, "-c", dump], check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _rank0(text: str) -> list[tuple[str, int, float]]:
    """Rank 0's story in time order, whichever node's log each line is in: ("step", n, loss) and
    ("resumed", n, 0.0). The lines' own timestamps order it (the nodes share this machine's clock)."""
    events = [(m.group(1), m.start(), "step", int(m.group(2)), float(m.group(3))) for m in STEP_RE.finditer(text)]
    events += [(m.group(1), m.start(), "resumed", int(m.group(2)), 0.0) for m in RESUMED_RE.finditer(text)]
    story: list[tuple[str, int, float]] = []
    for event in sorted(events):  # a resume from memory is said twice (the Checkpointer, then the job): once here
        if not (event[2] == "resumed" and story and story[-1] == event[2:]):
            story.append(event[2:])
    return story


def _lost_at_last_resume(story: list[tuple[str, int, float]]) -> list[int]:
    """Steps computed before the last resume that it did not keep (after its checkpoint): a grow-back that
    checkpoints on request and holds loses none."""
    last = max(i for i, e in enumerate(story) if e[0] == "resumed")
    return sorted({n for kind, n, _ in story[:last] if kind == "step" and n > story[last][1]})


def _steps(text: str) -> list[int]:
    return [n for kind, n, _ in _rank0(text) if kind == "step"]


def _check_continuation(story: list[tuple[str, int, float]], steps: int, *, require_replay: bool = True) -> int:
    """The last resume went on from the step after its checkpoint to the end, every step once, and the steps
    it replayed have the losses the larger world had: the same global batch, the same samples. Returns the
    checkpoint step it resumed from."""
    last = max(i for i, e in enumerate(story) if e[0] == "resumed")
    resumed = story[last][1]
    after = [n for kind, n, _ in story[last:] if kind == "step"]
    assert after == list(range(resumed + 1, steps + 1)), after
    first_losses = {}
    for kind, n, loss in story[:last]:
        if kind == "step":
            first_losses.setdefault(n, loss)
    replayed = [(n, first_losses[n], loss) for kind, n, loss in story[last:] if kind == "step" and n in first_losses]
    # a resume from a checkpoint of the very step the job had reached replays nothing (a grow-back can)
    assert replayed or not require_replay, "no step ran in both worlds"
    for n, before, again in replayed:
        assert again == pytest.approx(before, rel=1e-3), f"step {n}: loss {before} before the shrink, {again} after"
    return resumed


def _open_run_logs(pid: int) -> int:
    """How many of ``pid``'s fds are a run log: one for a whole run, however often it launched."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:  # closed meanwhile
            continue
    return sum(1 for target in targets if target.endswith("/logs/run.log"))


@pytest.mark.extended  # the node-loss path runs by default in the killed-node test
def test_a_partitioned_node_is_fenced_the_others_shrink_and_it_grows_the_job_back_when_healed(tmp_path):
    """The partitioned node's peers get no connection reset: they sit in a collective until the watchdog
    turns the silent wait into a restart. The node itself loses etcd, stops its workers (fencing) and, once
    healed, rejoins as a new member: the job grows back to three nodes and finishes."""
    steps, ckpt = 75, tmp_path / "shared" / "ckpt"  # the grow came at step 18 to 36 in test runs
    with TestBed(nodes=3, etcd_members=3, workdir=tmp_path / "bed") as bed:
        runs = {n: _start(bed, tmp_path, n, "mp", steps, ckpt) for n in ("n0", "n1", "n2")}
        logs = {n: log for n, (_, log) in runs.items()}

        def text(*nodes) -> str:
            return "".join(logs[n].read_text() for n in nodes or logs if logs[n].exists())

        wait_for(lambda: max(_steps(text()) or [0]) >= 12 or any(p.poll() is not None for p, _ in runs.values()),
                 240, what="the three-node job to reach step 12")
        assert all(p.poll() is None for p, _ in runs.values()), text()[-4000:]
        partitioned_at = time.monotonic()
        bed.partition("n2")
        wait_for(lambda: "fencing (stopping" in text("n2"), 60, what="n2 to fence itself")
        fenced_after = time.monotonic() - partitioned_at
        # from disk every rank says the RNG states stay; from memory rank 0 says it resharded
        wait_for(lambda: text("n0", "n1").count("world size 6, now 4") >= 2
                 or "taken at world size 6, now 4" in text("n0", "n1"), 120, what="the other nodes to resume as two")
        bed.heal("n2")
        wait_for(lambda: "rejoins job mp" in text("n2"), 60, what="n2 to rejoin")
        wait_for(lambda: "now 6" in text(), 180, what="the job to grow back to six ranks")
        # the fenced launch gave its fds back when n2 launched again (agent/launch/launched.py, session 37)
        assert _open_run_logs(runs["n2"][0].pid) == 1
        for node, (proc, log) in runs.items():
            assert proc.wait(300) == 0, f"{node}: " + log.read_text()[-4000:]
        story = _rank0(text())
        _check_continuation(story, steps, require_replay=False)
        assert "now 6" in text(), "the job never grew back to six ranks"
        assert "checkpoints after step" in text() and _lost_at_last_resume(story) == []
        assert fenced_after < 30, f"n2 trained on for {fenced_after:.0f} s without etcd"
        assert "hang" in text("n0", "n1")  # the silent wait was the watchdog's to end, not gloo's timeout
        print(f"partition -> n2 fenced after {fenced_after:.1f} s")
    assert bed.leftovers() == []


@pytest.mark.extended
def test_losing_etcd_quorum_fences_no_node_while_the_job_trains(tmp_path):
    """Two of the three etcd members down for longer than a node's membership lease: every node loses etcd
    at once, but their workers go on stepping together, so nobody is fenced and nothing restarts. No commit
    can be checked against the job's round meanwhile: those checkpoints are set aside, and commits resume
    when etcd does."""
    steps, ckpt = 120, tmp_path / "shared" / "ckpt"
    with TestBed(nodes=2, etcd_members=3, workdir=tmp_path / "bed") as bed:
        runs = {n: _start(bed, tmp_path, n, "mq", steps, ckpt, nnodes="2") for n in ("n0", "n1")}
        logs = {n: log for n, (_, log) in runs.items()}

        def text() -> str:
            return "".join(p.read_text() for p in logs.values() if p.exists())

        wait_for(lambda: max(_steps(text()) or [0]) >= 10 or any(p.poll() is not None for p, _ in runs.values()),
                 240, what="the two-node job to reach step 10")
        bed.kill("e0")
        bed.kill("e1")
        time.sleep(16)  # past the 10 s membership lease
        assert all(p.poll() is None for p, _ in runs.values()), text()[-4000:]
        bed.start_etcd_member("e0")
        bed.start_etcd_member("e1")
        for node, (proc, log) in runs.items():
            assert proc.wait(300) == 0, f"{node}: " + log.read_text()[-4000:]
        assert "fencing (stopping" not in text() and "round failed" not in text(), text()[-4000:]
        assert _steps(text()) == list(range(1, steps + 1))  # every step once: no restart
        assert "not committed: " in text() and "latest complete: step 120" in text()
    assert bed.leftovers() == []


@pytest.mark.extended  # ~80-140 s; hangs across nodes are also test_cluster_hangs.py's (7 tests, one etcd, no bed)
def test_a_hang_on_one_node_is_one_incident_that_names_the_rank_and_its_node(tmp_path):
    """Rank 3 (on n1) blocks at step 15; every rank of both nodes stops. Both nodes' watchdogs fire; one records
    the incident, naming rank 3 on n1 from n1's Flight Recorder dumps whichever node it is."""
    steps, ckpt = 40, tmp_path / "shared" / "ckpt"
    with TestBed(nodes=2, etcd_members=1, workdir=tmp_path / "bed") as bed:
        runs = {}
        for n in ("n0", "n1"):
            os.environ["TRAINWARDEN_FAULTS"] = "hang:rank=3,step=15"
            try:
                runs[n] = _start(bed, tmp_path, n, "mh", steps, ckpt, nnodes="2")
            finally:
                del os.environ["TRAINWARDEN_FAULTS"]
        for node, (proc, log) in runs.items():
            assert proc.wait(300) == 0, f"{node}: " + log.read_text()[-4000:]
        incidents = _etcd_incidents(bed, "mh")
        hangs = {i["id"]: i for i in incidents if i["kind"] == "hang"}  # the latest version of each
        assert len(hangs) == 1, [(i["id"], i["node"], i["state"]) for i in incidents]
        hang, = hangs.values()
        assert hang["ranks"] == [3] and hang["evidence"]["cluster"]["culprit_nodes"] == {"3": "n1"}, hang
        assert "rank 3 on n1" in hang["evidence"]["summary"]
    assert bed.leftovers() == []


def test_a_rank_computing_alone_on_one_node_is_not_a_hang_on_the_node_whose_ranks_wait_for_it(tmp_path):
    """An unchanged DDP script over two nodes of one rank each: rank 0 evaluates alone for 8 s while rank 1 waits
    in a barrier on the other node, using no CPU. That node sees no local activity, but rank 0's node says its rank
    works (jobs/<job>/busy/<node>): no hang, no restart. Before, the waiting node aborted the job after its 2 s
    deadline."""
    script = Path(__file__).resolve().parents[1] / "fixtures" / "unchanged" / "ddp_tutorial.py"
    with TestBed(nodes=2, etcd_members=1, workdir=tmp_path / "bed") as bed:
        runs = {}
        for n in ("n0", "n1"):
            env = dict(os.environ, TRAINWARDEN_STATE_HOME=str(tmp_path / n / "state"), OMP_NUM_THREADS="1")
            log = tmp_path / n / "run.log"
            runs[n] = (bed.spawn(n, [sys.executable, "-m", "trainwarden.agent.cli", "run", "--metrics-port", "0",
                                     "--nnodes", "2", "--nproc-per-node", "1", "--node", n, "--max-restarts", "0",
                                     "--job", "eval1", "--etcd", bed.etcd_endpoints, "--",
                                     str(script), "--steps", "30", "--sleep", "0.05", "--busy-rank", "0",
                                     "--busy-at", "12", "--busy-s", "8"], log=log, env=env), log)
        for node, (proc, log) in runs.items():
            assert proc.wait(240) == 0, f"{node}: " + log.read_text()[-4000:]
        text = "".join(log.read_text(errors="replace") for _, log in runs.values())
        assert "tutorial done" in text
        assert "are working: not a hang yet" in text  # the waiting node held its hang back
        kinds = [i["kind"] for i in _etcd_incidents(bed, "eval1")]
        assert "hang" not in kinds and "restart" not in kinds, kinds
    assert bed.leftovers() == []


@pytest.mark.extended  # ~170-290 s, the longest scenario; a lost node's ranks restored on the bed stay in the default
# suite (test_memory_reshard.py), and the node loss's rendezvous and incident in test_node_loss.py
def test_a_killed_node_leaves_the_survivors_shrink_and_when_it_returns_the_job_grows_back(tmp_path):
    """n2 loses power at step 12: the survivors detect it, restore the latest checkpoint into dp 2 and go on with
    the same global batch (accumulating more micro-batches) and the same samples: the steps they replay have
    the three-node losses. n2 is started again (its old membership record is a dead run's and is replaced at
    once), the job grows back to three nodes at an agreed checkpoint with no step lost, and finishes."""
    steps, ckpt = 75, tmp_path / "shared" / "ckpt"  # the grow came at step 18 to 28 in test runs
    with TestBed(nodes=3, etcd_members=3, workdir=tmp_path / "bed") as bed:
        runs = {n: _start(bed, tmp_path, n, "mr", steps, ckpt) for n in ("n0", "n1", "n2")}

        def text(*nodes) -> str:
            logs = [tmp_path / n / "run.log" for n in nodes or ("n0", "n1", "n2")]
            return "".join(p.read_text() for p in logs if p.exists())

        wait_for(lambda: max(_steps(text()) or [0]) >= 12 or any(p.poll() is not None for p, _ in runs.values()),
                 240, what="the three-node job to reach step 12")
        bed.kill("n2")
        # from disk every rank says the RNG states stay; from memory rank 0 says it resharded
        wait_for(lambda: text("n0", "n1").count("world size 6, now 4") >= 2
                 or "taken at world size 6, now 4" in text("n0", "n1"), 120, what="the other nodes to resume as two")
        (tmp_path / "n2" / "run.log").rename(tmp_path / "n2" / "killed.log")
        runs["n2"] = _start(bed, tmp_path, "n2", "mr", steps, ckpt)
        for node, (proc, log) in runs.items():
            assert proc.wait(300) == 0, f"{node}: " + log.read_text()[-4000:]
        assert "node n2 joins job mr" in text("n2"), text("n2")[-3000:]
        assert "now 6" in text(), "the job never grew back to six ranks"
        assert "round=native" in text("n0"), "trainwarden run's default rendezvous is the etcd-native round"
        # the killed run's log first: rank 0 may have been on n2 before the kill
        story = _rank0((tmp_path / "n2" / "killed.log").read_text() + text())
        # the shrink: the first resume that replayed steps (the first round may have closed with two nodes and
        # grown to three at a checkpoint, replaying nothing, when n2 came late on a loaded machine) replayed the
        # steps since its checkpoint with the three-node losses
        resumes = [i for i, e in enumerate(story) if e[0] == "resumed"]
        killed = next(i for i, e in enumerate(story) if e[0] == "step" and e[1] >= 12)  # n2 died after it
        shrink = next((i for i in resumes if i > killed), None)
        assert shrink is not None and len(resumes) >= 2, story
        end = next((i for i in resumes if i > shrink), len(story))
        # from the disk's step 10 it replays steps; from memory (the copies n2's ranks sent to n0) maybe none
        _check_continuation(story[:end], max(n for k, n, _ in story[:end] if k == "step"), require_replay=False)
        _check_continuation(story, steps, require_replay=False)
        # growing back: every worker saved after one agreed step and held there; the new round resumed from it
        assert "checkpoints after step" in text() and _lost_at_last_resume(story) == []
        # one survivor named the killed node, with its ranks of the last round
        import json
        lost = [json.loads(p.read_text()) for n in ("n0", "n1")
                for p in (tmp_path / n / "state" / "jobs" / "mr" / "incidents").glob("*.json")]
        lost = [i for i in lost if i["kind"] == "node_lost"]
        assert [(i["node"], len(i["ranks"])) for i in lost] == [("n2", 2)], lost
    assert bed.leftovers() == []
