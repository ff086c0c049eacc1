"""The README's Slurm recipe, run as written on a real Slurm cluster of lab hosts (root only).

The batch script is taken from the README itself ("On a cluster"), so the document is what is
tested; the only changes are the ones a cluster of four CPU-only nodes needs, each asserted
to apply (:data:`FOR_THIS_CLUSTER`). The lab's network is given its usual setting through the
environment sbatch passes on (``UCX_TLS=tcp,self``: MPI over the links), and the trainer is
``tests/slurm/_train.py`` in place of ``train.py``.

The story: a first allocation puts steps 1-3 on every rank; then one node dies (its daemon and
its trainer SIGKILLed, its ``/dev/shm`` emptied, as a replaced node comes back) and the job
fails; a second allocation with the same run name relaunches, the empty node takes the free
slot and is rebuilt before the daemons serve, and every rank reads step 3 back bit for bit and
goes on putting.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.harness import REPO
from bench.lab import Lab, janitor
from tests.slurm.cluster import SlurmCluster, missing_tools

NODES = 4
VICTIM = 2  # the node that dies
TRAINER = Path(__file__).with_name("_train.py")
# what four CPU-only lab nodes need changed in the README's script: (as written, here)
FOR_THIS_CLUSTER = [
    ("--nodes=64", f"--nodes={NODES}"),
    (" --gpus-per-node=8", ""),
    ("--nproc-per-node=8", "--nproc-per-node=1"),
    (" train.py", f" {TRAINER}"),
]


def readme_blocks() -> list[str]:
    """The bash blocks of the README's "On a cluster" section: the batch script, then the srun
    form of its daemon line."""
    section = (REPO / "README.md").read_text().split("\n## On a cluster\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def readme_script(srun_form: bool = False) -> str:
    """The README's batch script as this cluster runs it (:data:`FOR_THIS_CLUSTER`); with
    ``srun_form``, its daemon line replaced by the README's srun form."""
    script, srun = readme_blocks()[:2]
    for written, here in FOR_THIS_CLUSTER:
        assert written in script, f"the README's script no longer has {written!r}"
        script = script.replace(written, here)
    if srun_form:
        daemons = re.findall(r"^SLURM_OVERLAP=1 mpirun .*?&\n", script, re.S | re.M)
        assert len(daemons) == 1, script
        line = "".join(x + "\n" for x in srun.splitlines() if not x.startswith("#"))
        assert "srun --mpi=pmi2" in line, srun
        script = script.replace(daemons[0], line)
    return script


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests make network namespaces and run slurmd: run them as root")
    if missing_tools():  # a fresh machine: Debian's packages (as .ci/run does first)
        subprocess.run([str(REPO / "tests" / "tools" / "install-slurm.sh")], check=False)
    missing = missing_tools()
    if missing:
        pytest.fail(f"the Slurm tests need {missing}: apt-get install slurmctld slurmd "
                    "slurm-client munge (tests/tools/install-slurm.sh)")  # fmt: skip
    janitor()
    lab = Lab.up(hosts=NODES)
    cluster = SlurmCluster(lab)
    try:
        cluster.up()
        yield cluster
    finally:
        keep = os.environ.get("ECSNAP_KEEP_SLURM_LOGS")  # a directory: the run's logs go there
        try:
            if keep:
                shutil.copytree(
                    cluster.dir,
                    keep,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.sock", "cgroup"),  # not files to copy
                    ignore_dangling_symlinks=True,
                )
        finally:
            cluster.down()
            lab.down()


def _results(out: Path, phase: str, n: int, timeout: float, c: SlurmCluster, job: str) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [out / f"rank{r}-{phase}.json" for r in range(n)]
        if all(p.exists() for p in got):
            return [json.loads(p.read_text()) for p in got]
        state = c.job_state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.5)
    raise AssertionError(
        f"{phase}: ranks wrote {sorted(p.name for p in out.glob('rank*'))}; job {job} is "
        f"{c.job_state(job)}\n{_job_out(c)}\n{c.logs()}"
    )


def _afters(
    out: Path, phase: str, ranks: list[dict[str, Any]], timeout: float, c: SlurmCluster
) -> list[dict[str, Any]]:
    """The records of ``ranks`` once each says what its put after the go saw."""
    deadline = time.monotonic() + timeout
    while True:
        recs = [json.loads((out / f"rank{r['rank']}-{phase}.json").read_text()) for r in ranks]
        if all("after" in r for r in recs):
            return recs
        if time.monotonic() > deadline:
            raise AssertionError(f"{phase}: no put after the go ended on {recs}\n{_job_out(c)}")
        time.sleep(0.5)


def _job_out(c: SlurmCluster) -> str:
    """The batch jobs' output, their ends (the daemons log there, through mpirun)."""
    return "\n".join(
        f"== {p.name}\n{p.read_text()[-4000:]}" for p in sorted(c.dir.glob("job*.out"))
    )


def _sbatch(c: SlurmCluster, script: Path, phase: str, out: Path) -> str:
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "UCX_TLS": "tcp,self",  # the lab's MPI goes over its links (see bench/lab.py)
        "ECSNAP_TEST_OUT": str(out),
        "ECSNAP_TEST_PHASE": phase,
    }
    r = c.run("sbatch", "--parsable", "-o", str(c.dir / f"job-{phase}.out"), str(script), env=env)
    return r.stdout.strip().split(";")[0]


def test_the_readme_recipe_survives_a_node_loss(slurm: SlurmCluster) -> None:
    c, lab = slurm, slurm.lab
    script = readme_script()
    job_sh = c.dir / "job.sh"
    job_sh.write_text(script)
    out = c.dir / "out"
    out.mkdir()

    t0 = time.monotonic()
    job1 = _sbatch(c, job_sh, "first", out)
    first = _results(out, "first", NODES, 300, c, job1)
    print(
        f"first allocation: steps 1-3 protected on {NODES} ranks at {time.monotonic() - t0:.1f} s"
    )
    assert all(r["protected"] == [1, 2, 3] and r["found"] is None for r in first), first
    assert sorted(r["host"] for r in first) == sorted(lab.hosts)
    # a node dies: its daemon first, then (once the other ranks said what they saw: a dead
    # trainer makes torchrun end the others' at once) its trainer and what its /dev/shm held
    victim = lab.hosts[VICTIM]
    (found,) = lab.shm(VICTIM).glob(f"ecsnap-*/myrun/{victim}/health.json")  # ECSNAP_ROOT
    os.kill(int(json.loads(found.read_text())["pid"]), signal.SIGKILL)
    (out / "go-first").touch()  # the other ranks put once more, and see the storage job gone
    t1 = time.monotonic()
    survivors = _afters(out, "first", [r for r in first if r["host"] != victim], 120, c)
    print(f"node lost: {time.monotonic() - t1:.1f} s later the others saw:")
    for r in survivors:
        print(f"  rank {r['rank']}: {r['after']}")
    assert all(r["after"] != "protected" for r in survivors), survivors
    assert all(
        "the daemon that served this host has ended" in r["after"]
        or "closed the connection" in r["after"]
        or "Connection reset" in r["after"]
        for r in survivors
    ), survivors
    trainer = next(r for r in first if r["host"] == victim)
    try:
        os.kill(int(trainer["pid"]), signal.SIGKILL)
    except ProcessLookupError:
        pass  # it saw its daemon gone and is waiting: torchrun ends it
    for child in lab.shm(VICTIM).iterdir():
        shutil.rmtree(child)
    (out / "done-first").touch()
    ended = c.wait_job(job1, 180)
    assert ended in ("FAILED", "CANCELLED", "NODE_FAIL"), _job_out(c)

    # the relaunch: a new allocation, the same run name
    t2 = time.monotonic()
    job2 = _sbatch(c, job_sh, "second", out)
    second = _results(out, "second", NODES, 300, c, job2)
    print(f"relaunch: step 3 read back on every rank at {time.monotonic() - t2:.1f} s")
    assert all(r["found"] == 3 and r["exact"] for r in second), second
    assert all(r["protected"] == [4, 5, 6] for r in second), second
    (out / "go-second").touch()
    assert all(r["after"] == "protected" for r in _afters(out, "second", second, 120, c))
    (out / "done-second").touch()
    assert c.wait_job(job2, 180) == "COMPLETED", _job_out(c)
    log = (c.dir / "job-second.out").read_text()
    assert f"[{victim}] adoption: rebuilding step 3 before serving" in log, log[-3000:]
    assert "adoption: rebuilt step 3" in log


def test_the_srun_form_ends_the_storage_job_when_a_daemon_dies(slurm: SlurmCluster) -> None:
    """The README's srun form of the daemon line (``srun --mpi=pmi2``, no Hydra to end the job):
    steps 1-3 protected on every rank, then one node's daemon SIGKILLed. Every other daemon
    exits 3 (before: a segmentation fault inside MPI), says so in ``health.json``, and every
    other trainer's next put raises ``PeerUnreachableError`` naming the host that died."""
    c, lab = slurm, slurm.lab
    for i in range(NODES):  # a run of its own: nothing left from the other test
        for child in lab.shm(i).iterdir():
            shutil.rmtree(child)
    job_sh = c.dir / "job-srun.sh"
    job_sh.write_text(readme_script(srun_form=True))
    out = c.dir / "out-srun"
    out.mkdir()
    phase = "srun"
    job = _sbatch(c, job_sh, phase, out)
    first = _results(out, phase, NODES, 300, c, job)
    assert all(r["protected"] == [1, 2, 3] for r in first), first
    victim = lab.hosts[VICTIM]
    (found,) = lab.shm(VICTIM).glob(f"ecsnap-*/myrun/{victim}/health.json")
    os.kill(int(json.loads(found.read_text())["pid"]), signal.SIGKILL)
    (out / f"go-{phase}").touch()
    _afters(out, phase, first, 120, c)
    (out / f"done-{phase}").touch()
    c.wait_job(job, 180)
    log = (c.dir / f"job-{phase}.out").read_text()
    assert "Segmentation fault" not in log, log[-3000:]
    for i, host in enumerate(lab.hosts):
        if i == VICTIM:
            continue
        assert f"{host}: task {i}: Exited with exit code 3" in log, log[-3000:]
        (h,) = lab.shm(i).glob(f"ecsnap-*/myrun/{host}/health.json")
        health = json.loads(h.read_text())
        assert health["health"] == "unreachable peer" and health["unreachable"] == [victim]
    after = [json.loads((out / f"rank{r['rank']}-{phase}.json").read_text()) for r in first]
    for r in after:
        if r["host"] != victim:
            assert r["after"].startswith("PeerUnreachableError"), r
            assert f"host {victim}'s daemon is gone" in r["after"], r
