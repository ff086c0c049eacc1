"""``ecsnap demo``: a real training job loses part of its cluster and resumes bit-identically.

On this one machine: 4 virtual hosts run ecsnap daemons under ``mpiexec``; 4 training ranks (one
per host) train a small GPT on the CPU with gloo and a sharded optimizer, snapshotting every step.
At ``--fail-at`` the demo kills what ``--kill`` says, relaunches like a scheduler would (a new,
empty machine for a lost host), the trainers resume from the newest protected step, and every
loss after recovery is compared bit for bit with an uninterrupted run of the same seed.

    ecsnap demo                                  # kill a host at step 20 of 40
    ecsnap demo --kill 2hosts --m 1              # beyond m: the clear error, and the fallback
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KILLS = ("trainer", "daemons", "host", "2hosts", "none")


class Procs:
    """Processes this demo started, each in its own session, all killed on the way out."""

    def __init__(self) -> None:
        self.all: list[subprocess.Popen[str]] = []

    def start(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        stdout: Any = subprocess.PIPE,
        stdin: Any = subprocess.DEVNULL,
    ) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            args,
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            text=True,
            start_new_session=True,
        )
        self.all.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def kill_all(self) -> None:
        for p in self.all:
            self.kill(p)


class Demo:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.world = a.hosts
        self.procs = Procs()
        self.workdir = Path(a.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.workdir
        self.root = base / f"ecsnap-demo-{uuid.uuid4().hex[:8]}"
        self.job = "demo"
        self.hosts = [f"host{i}" for i in range(a.hosts)]
        self.tty = sys.stdout.isatty()
        self.daemons: subprocess.Popen[str] | None = None
        self.rebuild_s = 0.0
        self.endpoints: list[str] = []
        self.notes: list[str] = []

    def say(self, msg: str) -> None:
        print(("\r\033[K" if self.tty else "") + msg, flush=True)

    # -- the storage job ------------------------------------------------------------------------

    def start_daemons(self) -> None:
        from bench.harness import Cluster

        cluster = Cluster(
            self.root,
            hosts=self.a.hosts,
            k=self.a.k,
            m=self.a.m,
            extra=["--metrics-port", "0", "--metrics-addr", "127.0.0.1"],
            job=self.job,
            host_names=self.hosts,
            peer_timeout=120.0,
            timeout=300,
            log=self.workdir / "daemons.log",
        )
        self.daemons = cluster.proc
        self.procs.all.append(self.daemons)
        self.endpoints = [
            f"http://127.0.0.1:{(self.root / self.job / h / 'metrics.port').read_text().strip()}"
            f"/metrics ({h})"
            for h in self.hosts
        ]

    def scrape(self) -> dict[tuple[str, str], float]:
        """Every daemon's /metrics, read over HTTP as Prometheus reads it: each sample's value
        summed over the daemons, by (sample name, its ``kind`` label)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        out: dict[tuple[str, str], float] = {}
        for h in self.hosts:
            port = (self.root / self.job / h / "metrics.port").read_text().strip()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    key = (sample.name, sample.labels.get("kind", ""))
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def stop_daemons(self, sig: int = signal.SIGTERM) -> None:
        if self.daemons is not None:
            self.procs.kill(self.daemons, sig)
            self.daemons = None

    def info(self) -> list[dict[str, Any]]:
        from storage.status import gather

        return [h for h in gather(self.job, self.root) if h.get("running")]

    # -- the training job -----------------------------------------------------------------------

    def train(
        self, *, store: bool, resume: bool, kill_at: int | None = None, label: str = ""
    ) -> dict[str, Any]:
        """One run of the training job; launched again on another port when the one picked was
        taken before rank 0 bound it (other programs on the machine pick free ports too)."""
        from bench.harness import on_a_free_port

        return on_a_free_port(
            lambda port: self._train(store, resume, kill_at, label, port), f"{label}training"
        )

    def _train(
        self, store: bool, resume: bool, kill_at: int | None, label: str, port: int
    ) -> dict[str, Any]:
        cfg = {
            "steps": self.a.steps,
            "seed": self.a.seed,
            "model_size": self.a.model_size,
            "job": self.job if store else None,
            "root": str(self.root),
            "resume": resume,
            "fail_at": kill_at,
        }
        from bench.harness import _PORT_TAKEN, _PortTaken

        events: queue.Queue[tuple[int, dict[str, Any] | str]] = queue.Queue()
        trainers = []
        for rank in range(self.world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(self.world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                ECSNAP_HOST=self.hosts[rank],
                OMP_NUM_THREADS="1",
            )
            p = self.procs.start(
                [sys.executable, "-m", "bench.demo_train", json.dumps(cfg)], env=env
            )
            trainers.append(p)
            threading.Thread(target=_pump, args=(rank, p, events), daemon=True).start()
        losses: dict[int, str] = {}
        rows: dict[int, dict[str, Any]] = {}
        out: dict[str, Any] = {"losses": losses, "rows": rows, "events": [], "killed": None}
        done = 0
        logs: dict[int, list[str]] = {}
        while done < self.world:
            try:
                rank, ev = events.get(timeout=600)
            except queue.Empty:
                raise RuntimeError("the trainers stopped talking for 10 minutes") from None
            if isinstance(ev, str):
                if ev == "<exit>":
                    code = trainers[rank].wait()
                    if code != 0 and out["killed"] is None:
                        if any(m in line for line in logs.get(rank, []) for m in _PORT_TAKEN):
                            for p in trainers:
                                self.procs.kill(p)
                            raise _PortTaken()
                        raise RuntimeError(
                            f"trainer {rank} exited with {code}:\n"
                            + "\n".join(logs.get(rank, [])[-30:])
                        )
                    done += 1
                else:
                    logs.setdefault(rank, []).append(ev)
                continue
            if ev.get("event") == "step" and rank == 0:
                step = int(ev["step"])
                losses[step] = ev["loss"]
                rows[step] = ev
                if self.tty or step % 10 == 0 or step == self.a.steps - 1:
                    put = ev.get("put_block_s")
                    prot = ev.get("protect_s")
                    snap = (
                        f" | snapshot: blocking {put * 1e3:.1f} ms"
                        + (f", protected in {prot * 1e3:.0f} ms" if prot else "")
                        if put is not None
                        else ""
                    )
                    last = self.a.steps - 1
                    msg = f"{label}step {step} of 0-{last}: loss {ev['loss_f']:.4f}{snap}"
                    print(
                        ("\r\033[K" + msg) if self.tty else msg,
                        end="" if self.tty else "\n",
                        flush=True,
                    )
                if kill_at is not None and step >= kill_at and out["killed"] is None:
                    out["killed"] = step
                    for p in trainers:
                        self.procs.kill(p)
            elif ev.get("event") in ("resumed", "unrecoverable"):
                out["events"].append(ev)
        if self.tty:
            print()
        return out

    # -- the show ---------------------------------------------------------------------------------

    def reference(self) -> dict[int, str]:
        key = hashlib.sha256(
            json.dumps(
                [
                    self.a.steps,
                    self.a.seed,
                    self.a.model_size,
                    self.world,
                    sys.version,
                    _torch_version(),
                ]
            ).encode()
        ).hexdigest()[:16]
        cache = self.workdir / f"reference-{key}.json"
        if cache.exists():
            self.say(f"uninterrupted reference run: cached in {cache}")
            return {int(k): v for k, v in json.loads(cache.read_text()).items()}
        self.say("uninterrupted reference run (no snapshots, no failure)...")
        ref: dict[int, str] = self.train(store=False, resume=False, label="reference ")["losses"]
        cache.write_text(json.dumps(ref))
        return ref

    def fail(self, kill: str) -> None:
        """The failure, then what a scheduler does about it."""
        if kill == "trainer":
            self.say("killed every trainer (the daemons keep the snapshots)")
            return
        self.stop_daemons(signal.SIGKILL)
        if kill == "daemons":
            self.say("killed the trainers and every daemon (SIGKILL): shared memory stays")
        else:
            lost = self.hosts[1:2] if kill == "host" else self.hosts[1:3]
            for h in lost:
                shutil.rmtree(self.root / self.job / h)
                new = f"{h}-new"
                self.hosts[self.hosts.index(h)] = new
                self.notes.append(f"{h} lost: its trainer, daemon and memory; replaced by {new}")
            self.say(
                f"lost {', '.join(lost)} (trainers, daemons, memory wiped); "
                f"replacement machines: {', '.join(h + '-new' for h in lost)}"
            )
        t0 = time.perf_counter()
        self.start_daemons()
        relaunch = time.perf_counter() - t0
        self.rebuild_s = max(h["stats"]["rebuild_seconds"] for h in self.info())
        self.say(f"relaunched the daemons in {relaunch:.1f}s (rebuild {self.rebuild_s:.2f}s)")

    def run(self) -> int:
        a = self.a
        self.say(
            f"ecsnap demo: {a.hosts} virtual hosts, {self.world} ranks, model "
            f"{a.model_size}, steps 0-{a.steps - 1}, kill {a.kill} at step {a.fail_at}"
        )
        ref = self.reference()
        self.start_daemons()
        self.say("daemons up; training with a snapshot every step")
        first = self.train(
            store=True, resume=False, kill_at=None if a.kill == "none" else a.fail_at
        )
        second: dict[str, Any] = {"losses": {}, "rows": {}, "events": []}
        if a.kill != "none":
            self.fail(a.kill)
            second = self.train(store=True, resume=True, label="resumed ")
        for ev in second["events"]:
            if ev.get("event") == "unrecoverable" and ev.get("rank") == 0:
                self.say("ecsnap says: " + ev["message"])
        resumed = [e for e in second["events"] if e.get("event") == "resumed"]
        start = resumed[0]["step"] if resumed else None
        if resumed and resumed[0].get("from_scratch"):
            self.notes.append(
                "no snapshot could be rebuilt and no persistent tier is "
                "configured: training restarted from scratch (step 0)"
            )
        losses = dict(first["losses"])
        losses.update(second["losses"])
        same = [s for s in sorted(losses) if losses[s] == ref.get(s)]
        differ = [s for s in sorted(losses) if losses[s] != ref.get(s)]
        identical = not differ and len(losses) == a.steps
        self.summary(first, second, ref, start, identical, differ)
        self.chart(first, second, ref, start)
        if self.tty:
            try:
                input("the daemons stay up for a look at their /metrics; Enter stops them ")
            except EOFError:
                pass
        result = {
            "identical": identical,
            "resumed_at": start,
            "killed_at": first["killed"],
            "steps_compared": len(same),
            "differ": differ,
            "rebuild_s": self.rebuild_s,
            "notes": self.notes,
        }
        (self.workdir / "demo-result.json").write_text(json.dumps(result, indent=2))
        return 0 if identical else 1

    def summary(
        self,
        first: dict[str, Any],
        second: dict[str, Any],
        ref: dict[int, str],
        start: int | None,
        identical: bool,
        differ: list[int],
    ) -> None:
        rows = {**first["rows"], **second["rows"]}
        puts = [r["put_block_s"] for r in rows.values() if r.get("put_block_s") is not None]
        prots = [r["protect_s"] for r in rows.values() if r.get("protect_s")]
        scraped = self.scrape()
        data = scraped.get(("ecsnap_stored_bytes", "data"), 0.0)
        parity = scraped.get(("ecsnap_stored_bytes", "parity"), 0.0)
        enc_b = scraped.get(("ecsnap_encode_bytes_total", ""), 0.0)
        enc_s = scraped.get(("ecsnap_encode_seconds_total", ""), 0.0) or float("nan")
        each = f"summed over the {len(self.hosts)} daemons' /metrics"
        killed = first["killed"]
        lost = (killed - start + 1) if (killed is not None and start is not None) else 0
        med = _median
        lines = [
            (
                "result",
                "every loss bit-identical to the uninterrupted run"
                if identical
                else f"DIFFERENT at steps {differ[:10]}",
            ),
            ("failure", f"--kill {self.a.kill} at step {killed}" if killed is not None else "none"),
            (
                "resumed",
                "-"
                if start is None
                else (
                    f"at step {start}, from the snapshot of step {start - 1} (the newest protected)"
                    if start
                    else "at step 0: no snapshot could be read"
                ),
            ),
            ("steps lost", str(lost)),
            ("snapshot blocking per step", f"median {med(puts) * 1e3:.1f} ms"),
            ("put -> protected", f"median {med(prots) * 1e3:.0f} ms" if prots else "-"),
            (
                "encode throughput",
                f"{enc_b / enc_s / 1e9:.2f} GB/s while encoding (ecsnap_encode_bytes_total / "
                f"ecsnap_encode_seconds_total, {each})",
            ),
            (
                "rebuild time",
                f"{self.rebuild_s:.2f} s (ecsnap_rebuild_seconds)" if self.rebuild_s else "-",
            ),
            (
                "memory for protection",
                f"{parity / 1e6:.1f} MB parity for {data / 1e6:.1f} MB "
                f"of snapshots ({parity / max(data, 1):.2f}x; ecsnap_stored_bytes by kind, "
                f"{each}); 2-way replication: {data / 1e6:.1f} MB (1.00x)",
            ),
        ]
        if self.tty:  # the daemons stay up until Enter (see run): the addresses still answer
            lines.append(("metrics", "; ".join(self.endpoints)))
        width = max(len(k) for k, _ in lines)
        print("\n" + "-" * 72)
        for k, v in lines:
            print(f"{k.ljust(width)}  {v}")
        for n in self.notes:
            print(f"{'note'.ljust(width)}  {n}")
        print("-" * 72)

    def chart(
        self, first: dict[str, Any], second: dict[str, Any], ref: dict[int, str], start: int | None
    ) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.say("(matplotlib is not installed: no chart)")
            return
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
        rs = sorted(ref)
        ax1.plot(rs, [float.fromhex(ref[s]) for s in rs], color="0.6", lw=4, label="uninterrupted")
        for run, name in ((first, "before the failure"), (second, "after recovery")):
            ss = sorted(run["losses"])
            if ss:
                ax1.plot(ss, [float.fromhex(run["losses"][s]) for s in ss], lw=1.2, label=name)
        if first["killed"] is not None:
            for ax in (ax1, ax2):
                ax.axvline(first["killed"], color="red", ls="--", lw=1)
            ax1.text(
                first["killed"], ax1.get_ylim()[1], f" --kill {self.a.kill}", color="red", va="top"
            )
        ax1.set_ylabel("loss")
        ax1.legend()
        rows = {**first["rows"], **second["rows"]}
        ss = sorted(s for s in rows if rows[s].get("put_block_s") is not None)
        ax2.plot(ss, [rows[s]["put_block_s"] * 1e3 for s in ss], ".", label="snapshot blocking")
        pp = [s for s in ss if rows[s].get("protect_s")]
        ax2.plot(pp, [rows[s]["protect_s"] * 1e3 for s in pp], ".", label="put -> protected")
        ax2.set_yscale("log")
        ax2.set_ylabel("ms")
        ax2.set_xlabel("step")
        ax2.legend()
        fig.suptitle(
            f"ecsnap demo: {self.a.hosts} hosts, kill {self.a.kill} at step {first['killed']}"
        )
        fig.tight_layout()
        out = self.workdir / "demo.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        self.say(f"chart: {out}")

    def cleanup(self) -> None:
        self.procs.kill_all()
        shutil.rmtree(self.root, ignore_errors=True)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def _pump(
    rank: int, p: subprocess.Popen[str], events: queue.Queue[tuple[int, dict[str, Any] | str]]
) -> None:
    assert p.stdout is not None
    for line in p.stdout:
        line = line.strip()
        if line.startswith("{"):
            try:
                events.put((rank, json.loads(line)))
                continue
            except ValueError:
                pass
        if line:
            events.put((rank, f"log: {line}"))
    events.put((rank, "<exit>"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ecsnap demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--m", type=int, default=None)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fail-at", type=int, default=20)
    p.add_argument("--kill", choices=KILLS, default="host")
    p.add_argument("--model-size", choices=("tiny", "small", "medium"), default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="ecsnap-demo")
    a = p.parse_args(argv)
    if (a.k is None) != (a.m is None):
        p.error("give both --k and --m, or neither")
    if not 0 <= a.fail_at < a.steps:
        p.error("--fail-at must be a step in 0..steps-1")
    if a.kill == "2hosts" and a.hosts < 3:
        p.error("--kill 2hosts needs at least 3 hosts")
    from storage.launch import sweeping_hydra_files

    demo = Demo(a)
    with sweeping_hydra_files():  # the SIGKILLed job's
        try:
            return demo.run()
        except KeyboardInterrupt:
            print("\ninterrupted: stopping every process the demo started", file=sys.stderr)
            return 130
        finally:
            demo.cleanup()
