"""What the tests and the benchmarks share: one cluster launcher, one state generator, one
bit-exact comparer.

    cluster = Cluster(root, hosts=4, k=3, m=1)        # mpiexec -n 4 ecsnap serve --virtual-hosts
    stores = cluster.stores(4)                        # one Store per rank, rank r on host r
    stores[0].put(1, make_state(0, 1)).wait()
    assert_same(stores[0].get(1), make_state(0, 1))  # bit for bit, with the key path on failure
    cluster.stop()                                    # SIGTERM; returns mpiexec's exit status

Ranks in processes of their own run ``python -m MODULE '<json spec>'`` through
:meth:`Cluster.processes` (forked from a server that imported torch once: :mod:`bench.forks`);
each prints one JSON line of results last.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "REPO", "Cluster", "assert_same", "close_all", "kill_group", "make_state", "nbytes_of", "same",
    "terminate",
]  # fmt: skip

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


class Cluster:
    """The daemons of one job under ``root`` (virtual hosts on this machine).

    The constructor starts them and returns once every daemon is ready; it raises RuntimeError
    (with the log) if they die first or are not ready within ``timeout``. ``stop()`` sends
    SIGTERM and returns mpiexec's exit status; ``kill()`` SIGKILLs the whole job. The log of
    every launch of the job is appended to ``root/<job>.log``.
    """

    def __init__(
        self,
        root: Path,
        hosts: int = 4,
        k: int | None = None,
        m: int | None = None,
        extra: Sequence[str] = (),
        job: str | None = None,
        host_names: list[str] | None = None,
        env: dict[str, str] | None = None,
        peer_timeout: float = 60.0,
        timeout: float = 120.0,
        log: Path | None = None,
    ) -> None:
        from storage import launch

        self.root = root
        self.job = job or f"t{uuid.uuid4().hex[:8]}"
        self.hosts = hosts
        self.k, self.m = k, m
        self.extra = list(extra)
        self.env = env
        self.host_names = host_names or [f"host{i}" for i in range(hosts)]
        self.custom_names = host_names is not None
        self.peer_timeout = peer_timeout
        self.log = log or root / f"{self.job}.log"
        self.proc = launch.start(
            hosts,
            self.job,
            root,
            self.log,
            virtual_hosts=host_names,
            k=k,
            m=m,
            extra=["--peer-timeout", str(peer_timeout), *self.extra],
            cwd=REPO,
            timeout=timeout,
            env=env,
        )

    def relaunch(self, **changes: Any) -> Cluster:
        """The same job launched again (after :meth:`kill` or :meth:`stop`), ``changes`` applied
        to the arguments this one was started with."""
        args: dict[str, Any] = {
            "hosts": self.hosts,
            "k": self.k,
            "m": self.m,
            "extra": self.extra,
            "job": self.job,
            "host_names": self.host_names if self.custom_names else None,
            "peer_timeout": self.peer_timeout,
            "log": self.log,
        }
        args.update(changes)
        return Cluster(self.root, **args)

    def stores(
        self, world: int, timeout: float = 60.0, incremental: bool | None = None
    ) -> list[Any]:
        """One :class:`storage.Store` in this process per rank, rank r on the r-th host
        (``incremental`` as :func:`storage.connect`'s)."""
        import storage

        return [
            storage.connect(
                self.job,
                rank=r,
                world_size=world,
                host=self.host_names[r % self.hosts],
                root=self.root,
                timeout=timeout,
                incremental=incremental,
            )
            for r in range(world)
        ]

    def processes(
        self, module: str, specs: list[dict[str, Any]], timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        """Run ``python -m module SPEC`` once per spec, all at once, each a process of its own
        forked from a server that imported torch once (:mod:`bench.forks`); return each one's
        last JSON line. A process that fails or outlives ``timeout`` fails the call with its
        stderr and the daemons' log."""
        from bench import forks

        runs = [forks.start(module, [json.dumps(spec)]) for spec in specs]
        results = []
        deadline = time.monotonic() + timeout
        try:
            for i, run in enumerate(runs):
                code = run.wait(max(1.0, deadline - time.monotonic()))
                if code is None:
                    raise AssertionError(
                        f"{module} process {i} hung; daemon log:\n{self.log.read_text()}"
                    )
                out, err = run.output()
                if code != 0:
                    raise AssertionError(
                        f"{module} process {i} failed ({code}):\n{err}\n--- daemons:\n"
                        f"{self.log.read_text()}"
                    )
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for run in runs:
                run.kill()
                run.output()
        return results

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def daemon_pid(self, name: str) -> int:
        """The pid of virtual host ``name``'s daemon (from the health file each daemon writes)."""
        health = json.loads((self.root / self.job / name / "health.json").read_text())
        return int(health["pid"])

    def stop(self, timeout: float = 30.0) -> int:
        if not terminate(self.proc, timeout):
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        kill_group(self.proc)


PORT_TRIES = 3  # launches of gloo_ranks' ranks on fresh ports when the one picked was taken
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it before
    the ranks bind it: :func:`gloo_ranks` then launches them again on another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_ranks(
    module: str, spec: dict[str, Any], world: int, what: str, timeout: float = 1800.0
) -> list[dict[str, Any]]:
    """Run ``python -m module --worker SPEC`` as ``world`` training ranks (RANK, WORLD_SIZE and
    a free MASTER_PORT for torch.distributed; rank r talks to the daemon of ``host<r>``); return
    each rank's last line of stdout as JSON, in rank order. Raises RuntimeError naming ``what``
    if a rank fails.

    The port is free when picked, not reserved: a run of ``ecsnap bench train`` ended in its
    fifth repeat when rank 0's TCPStore found it taken (EADDRINUSE) by then. A launch whose first
    failed rank says so (rank 0 serves the store and fails at once; it is waited for first) is
    run again on another port, at most ``PORT_TRIES`` times. Each rank's stderr goes to a file,
    copied to this process's stderr once the ranks are done."""
    return on_a_free_port(lambda port: _launch(module, spec, world, what, timeout, port), what)


def on_a_free_port(launch: Callable[[int], T], what: str) -> T:
    """``launch(port)`` on a port free when picked; launched again on another when it raises
    :class:`_PortTaken` (the port was taken before the ranks bound it), at most
    ``PORT_TRIES`` times."""
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        try:
            return launch(port)
        except _PortTaken:
            if attempt == PORT_TRIES:
                raise RuntimeError(
                    f"{what}: the training ranks found their port taken {PORT_TRIES} times"
                ) from None
            print(f"{what}: port {port} was taken: launching the ranks again", file=sys.stderr)
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _launch(
    module: str, spec: dict[str, Any], world: int, what: str, timeout: float, port: int
) -> list[dict[str, Any]]:
    procs = []
    with tempfile.TemporaryDirectory(prefix="ecsnap-ranks-") as tmp:
        errs = [Path(tmp) / f"rank{rank}.err" for rank in range(world)]
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ECSNAP_HOST": f"host{rank}",
            }
            with errs[rank].open("w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, "--worker", json.dumps(spec)],
                        env=env,
                        cwd=REPO,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        out = []
        failed = None  # (rank, exit status) of the first rank found failed
        try:
            for rank, p in enumerate(procs):
                stdout, _ = p.communicate(timeout=timeout)
                if p.returncode != 0:
                    failed = (rank, p.returncode)
                    break
                out.append(json.loads(stdout.strip().splitlines()[-1]))
        finally:
            _reap(procs)  # the ranks left when one failed, or the benchmark was stopped
            texts = [e.read_text(errors="replace") for e in errs]
            for text in texts:
                sys.stderr.write(text)
            sys.stderr.flush()
        if failed is not None:
            rank, status = failed
            if any(m in texts[rank] for m in _PORT_TAKEN):  # its own error, no other rank's
                raise _PortTaken()
            raise RuntimeError(f"a training rank failed ({status}) in {what}")
        return out


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc``'s process group if it still runs, and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def terminate(proc: subprocess.Popen[str], timeout: float) -> bool:
    """SIGTERM ``proc``'s process group and wait; False if it is still running after ``timeout``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
    return True


def close_all(stores: list[Any]) -> None:
    """Close every Store, whatever state its daemon is in (a fault may have taken it)."""
    for s in stores:
        try:
            s.close()
        except Exception:
            pass
    stores.clear()


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    """Kill the processes still running and reap them; those already reaped (their output read
    by ``communicate``, whose pipes are closed) are left alone."""
    for q in procs:
        if q.returncode is not None:
            continue
        if q.poll() is None:
            q.kill()
        q.communicate()


def make_state(
    rank: int,
    step: int,
    *,
    nbytes: int = 750_000,
    tensors: int = 3,
    every_kind: bool = False,
    scale: int = 1,
    model: int = 0,
    frozen: int = 0,
) -> dict[str, Any]:
    """The state rank ``rank`` puts at ``step``: the same for the same arguments, bit for bit.

    ``tensors`` tensors of about ``nbytes`` together (float32, bfloat16 and int64 in turn,
    1024 columns where they have that many elements). With ``model``, instead a state shaped
    like a model's and its AdamW optimizer's, of ``model`` small tensors: a third of them
    parameters of 64 to 512 elements (named like a transformer's), each with ``exp_avg`` and
    ``exp_avg_sq``, and a step counter per parameter. With ``every_kind``, also every kind of
    leaf a trainer puts: a model's, an optimizer's and a scheduler's state dicts (their width
    grows with ``scale``), each dtype ecsnap stores, views sharing storage, a non-contiguous and
    a zero-size tensor, numpy arrays and scalars, RNG states, a StatefulDataLoader's state and
    plain values (NaN, bytes, None, an int key, a torch.Size, a dtype, an OrderedDict). With
    ``frozen``, also ``frozen`` bytes that are the same at every step (a frozen tower: after the
    first put, incremental puts store them as references).
    """
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    if frozen:
        tower = torch.randn(frozen // 4, generator=torch.Generator().manual_seed(rank + 77))
        return {
            "frozen.w": tower,
            **make_state(
                rank,
                step,
                nbytes=nbytes,
                tensors=tensors,
                every_kind=every_kind,
                scale=scale,
                model=model,
            ),
        }
    if model:
        return _model_shaped(model, step, g)
    per = max(nbytes // max(tensors, 1), 8)
    state: dict[Any, Any] = {}
    for i in range(tensors):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        n = max(per // torch.empty(0, dtype=dtype).element_size(), 1)
        if dtype == torch.int64:
            t = torch.randint(0, 1 << 30, (n,), generator=g)
        else:
            t = torch.empty(n, dtype=torch.float32).uniform_(generator=g).to(dtype)
        state[f"layer{i // 3}.w{i % 3}"] = t.view(-1, 1024) if n % 1024 == 0 else t
    if every_kind:
        state.update(_every_kind(rank, step, scale, g))
    return state


def _model_shaped(tensors: int, step: int, g: torch.Generator) -> dict[str, Any]:
    names = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3", "norm")
    model = {}
    for i in range(max(tensors // 3, 1)):
        name = f"layers.{i // len(names)}.{names[i % len(names)]}.weight"
        model[name] = torch.randn(64 << (i % 4), generator=g)
    state = {
        i: {"step": torch.tensor(float(step)), "exp_avg": t.clone(), "exp_avg_sq": t.square()}
        for i, t in enumerate(model.values())
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(state)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def _every_kind(rank: int, step: int, scale: int, g: torch.Generator) -> dict[str, Any]:
    torch.manual_seed(rank * 7 + step)
    model = torch.nn.Sequential(
        torch.nn.Linear(16 * scale, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model(torch.randn(8, 16 * scale, generator=g)).square().mean().backward()
    opt.step()
    sched.step()
    dtypes = {}
    for dt in DTYPES:
        base = torch.randn(5, 7, generator=g) * 10
        dtypes[str(dt)] = base.to(dt) if dt != torch.bool else base > 0
    big = torch.randn(300 * scale, 1000 + rank, generator=g)
    shared = torch.arange(40, dtype=torch.float32) + step
    nprng = np.random.default_rng(rank + step)
    pyrng = random.Random(rank * 31 + step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's own deprecation noise
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(list(range(50)), batch_size=4, shuffle=False)
        it = iter(loader)
        for _ in range(step % 5 + 1):
            next(it)
        loader_state = loader.state_dict()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "dtypes": dtypes,
        "big": big,
        "bf16": torch.randn(64, 129, generator=g).to(torch.bfloat16),
        "noncontig": big[:, ::3].t(),
        "zero": torch.empty(0, 3, 0),
        "scalar": torch.tensor(3.25),
        "shared": (shared[:10], shared[5:25].view(4, 5)),
        "numpy": {
            "f": nprng.standard_normal((3, 4)),
            "i": np.arange(7, dtype=np.int16),
            "scalar": np.float32(1.5),
        },
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": nprng.bit_generator.state,
            "python": pyrng.getstate(),
        },
        "loader": loader_state,
        "meta": {
            "step": step,
            "rank": rank,
            "lr": 1e-3,
            "nan": float("nan"),
            "name": "x",
            "blob": b"\x00\x01",
            "none": None,
            "flags": [True, False],
            7: "int key",
            "size": torch.Size([2, 3]),
            "dtype": torch.bfloat16,
            "od": collections.OrderedDict(a=1),
        },
    }


def nbytes_of(state: dict[str, Any]) -> int:
    """Bytes of the tensors at the top level of ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """``a`` is ``b`` bit for bit: types, keys in order, dtypes, shapes and every byte (NaN
    equals NaN). Raises AssertionError naming the first key path that differs."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        if a.numel():
            ca, cb = a.detach().contiguous(), b.detach().contiguous()
            assert torch.equal(
                ca.reshape(-1).view(torch.uint8), cb.reshape(-1).view(torch.uint8)
            ), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def same(a: Any, b: Any) -> bool:
    """:func:`assert_same` as a test: True when ``a`` is ``b`` bit for bit."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True
