"""One trainer rank in its own process: ``python -m tests.mpi._trainer '<json spec>'``.

Runs the named scenario against the real daemons and prints one JSON line of results.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import storage
from bench.harness import Cluster, assert_same, make_state
from storage import Store


def trainers(
    cluster: Cluster,
    scenario: str,
    world: int,
    per_host: int,
    params: dict[str, Any],
    timeout: float = 120.0,
    hosts: list[str] | None = None,
    only: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Run ``world`` trainer processes of ``scenario`` (rank r on host r // per_host, or only
    the ranks in ``only``); return their results in rank order."""
    names = hosts or cluster.host_names
    specs = [
        {
            "scenario": scenario,
            "job": cluster.job,
            "root": str(cluster.root),
            "rank": rank,
            "world": world,
            "host": names[rank // per_host],
            "params": params,
        }
        for rank in (only if only is not None else range(world))
    ]
    return cluster.processes("tests.mpi._trainer", specs, timeout)


def round_trip(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Overlapping puts of steps 1 and 2, reads of own and a foreign rank, retention by step 3."""
    s1, s2 = make_state(rank, 1, every_kind=True), make_state(rank, 2, every_kind=True)
    h1 = store.put(1, s1)
    h2 = store.put(2, s2)  # before step 1 is protected
    h1.staged.result(60)
    h2.staged.result(60)
    assert h1.wait(60) == 1 and h2.wait(60) == 2
    assert store.latest_step() == 2 and store.steps() == [1, 2]
    assert_same(store.get(1), s1)
    assert_same(store.get(), s2)
    other = (rank + p["per_host"]) % world  # a rank that lives on another host
    assert_same(store.get(2, rank=other), make_state(other, 2, every_kind=True))
    st = store.status(2)
    assert st.protected and st.ranks_staged == list(range(world))
    held = store.get(1)  # views of step 1's shared memory, kept across its eviction
    with_3 = make_state(rank, 3, every_kind=True)
    store.put(3, with_3).wait(60)
    steps = store.steps()
    assert steps == [2, 3], steps  # keep=2: step 1 evicted by the protection of step 3
    view = store.get(3)
    view["big"].add_(1)  # copy-on-write: the snapshot does not change
    view["numpy"]["f"][:] = 0
    assert_same(store.get(3), with_3)
    try:
        store.get(1)
        raise AssertionError("evicted step 1 still readable")
    except storage.StepNotFoundError:
        pass
    store.put(4, make_state(rank, 4, every_kind=True)).wait(
        60
    )  # needs memory: not step 1's, still leased
    assert_same(held, s1)
    del held
    try:
        store.put(3, with_3)
        raise AssertionError("duplicate step accepted")
    except storage.StepExistsError:
        pass
    return {"info": store.info(), "status": st.__dict__}


def partial(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Step 1 put by all, step 2 by even ranks only: step 2 must never become visible."""
    store.put(1, make_state(rank, 1, every_kind=True, scale=2)).wait(60)
    if rank % 2 == 0:
        h = store.put(2, make_state(rank, 2, every_kind=True))
        h.staged.result(60)
    seen = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        seen.add(store.latest_step())
        seen.update(store.steps())
        time.sleep(0.01)
    assert seen == {1}, seen
    try:
        store.get(2)
        raise AssertionError("unprotected step readable")
    except storage.StepNotFoundError:
        pass
    state = store.status(2).state if rank % 2 == 0 else None
    return {"seen": sorted(seen), "state2": state}


def capacity(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """A put over the memory budget fails with CapacityError; what was stored stays bit-exact."""
    small = make_state(rank, 1, every_kind=True)
    store.put(1, small).wait(60)
    import torch

    huge = {"x": torch.ones(p["huge_bytes"] // 4)}
    try:
        store.put(2, huge)
        raise AssertionError("over-budget put accepted")
    except storage.CapacityError as exc:
        message = str(exc)
    assert store.steps() == [1]
    assert_same(store.get(1), small)
    store.put(3, make_state(rank, 3, every_kind=True)).wait(60)  # the service still works
    assert store.steps() == [1, 3]
    return {"message": message}


def bad_input(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    import threading

    import torch

    errors = {}
    try:
        store.put(1, {"ok": torch.ones(3), "bad": {"inner": [threading.Lock()]}})
    except storage.UnsupportedTypeError as exc:
        errors["unsupported"] = exc.path
    for bad in (-1, "7", 1.5, None):
        try:
            store.put(bad, {})  # type: ignore[arg-type]
        except ValueError as exc:
            errors.setdefault("step", str(exc))
    try:
        store.get(99)
    except storage.StepNotFoundError as exc:
        assert isinstance(exc, KeyError)
        errors["missing"] = str(exc)
    good = make_state(rank, 1, every_kind=True)
    store.put(1, good).wait(60)  # the rejected put left nothing behind
    assert_same(store.get(1), good)
    if rank == 0:
        store.delete(1)
        try:
            store.delete(1)
        except storage.StepNotFoundError:
            errors["delete_twice"] = "ok"
    return {"errors": errors}


def put(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Put ``steps`` (all protected); then ``partial`` steps only staged, by ``partial_ranks``."""
    for step in p.get("steps", []):
        store.put(step, make_state(rank, step, every_kind=True)).wait(60)
    for step in p.get("partial", []):
        if rank in p.get("partial_ranks", []):
            store.put(step, make_state(rank, step, every_kind=True)).staged.result(60)
    return {"steps": store.steps()}


def check(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Read every rank of ``steps`` from this host and compare bit for bit; report errors."""
    out: dict[str, Any] = {"steps": store.steps(), "latest": store.latest_step(), "errors": {}}
    before = store.info()
    for step in p.get("steps", []):
        for r in p.get("ranks", range(world)):
            try:
                assert_same(
                    store.get(step, rank=r),
                    make_state(r, step, every_kind=True),
                    f"step {step} rank {r}",
                )
            except storage.SnapshotUnrecoverableError as exc:
                out["errors"][f"{step}/{r}"] = {
                    "type": "unrecoverable",
                    "lost_hosts": exc.lost_hosts,
                    "ranks": exc.ranks,
                    "newest": exc.newest_recoverable,
                    "msg": str(exc),
                }
            except storage.StepNotFoundError as exc:
                out["errors"][f"{step}/{r}"] = {"type": "not_found", "msg": str(exc)}
            except storage.StorageError as exc:
                out["errors"][f"{step}/{r}"] = {"type": type(exc).__name__, "msg": str(exc)}
    if p.get("get_none"):
        latest = store.latest_step()
        got = store.get()
        assert_same(got, make_state(rank, latest, every_kind=True))
        out["get_none"] = latest
    after = store.info()
    out["sent_delta"] = after["sent_bytes"] - before["sent_bytes"]
    out["received_delta"] = after["received_bytes"] - before["received_bytes"]
    out["info"] = after
    out["status"] = {str(s): store.status(s).state for s in out["steps"]}
    return out


def interactive(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Put step 1; put step 2 alone (never protected); then let the test kill and relaunch the
    daemons (it writes a line on stdin) and check: step 2's put failed, the Store reconnected."""
    state = make_state(rank, 1, every_kind=True)
    store.put(1, state).wait(60)
    h = store.put(2, make_state(rank, 2, every_kind=True))
    h.staged.result(60)
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        h.wait(120)
        outcome = "protected?!"
    except storage.DaemonUnavailableError as exc:
        outcome = f"failed: {exc}"
    waited = time.monotonic() - t0
    sys.stdin.readline()  # the daemons are back
    assert_same(store.get(1), state)
    gc.collect()  # that get's views are gone: its lease is given back with the next request
    print("AGAIN", flush=True)
    sys.stdin.readline()  # relaunched once more: the lease died with the daemon that granted it
    assert_same(store.get(1), state)
    return {"outcome": outcome, "waited": waited, "steps": store.steps()}


def guarded(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """A training loop that puts right after optimizer.step() and relies on store.guard: every
    snapshot must hold the parameters as they were at its put, never a later step's."""
    import torch

    device = p.get("device", "cpu")
    torch.manual_seed(rank)
    model = torch.nn.Linear(2048, 2048).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hook = store.guard(opt)
    expected = {}
    handles = []
    for step in range(1, 5):
        loss = model(torch.randn(16, 2048, device=device)).square().mean()
        loss.backward()
        opt.step()  # waits for the previous put's copy
        opt.zero_grad()
        expected[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        handles.append(store.put(step, model.state_dict()))
    for h in handles:
        h.wait(60)
    hook.remove()
    kept = store.steps()
    for step in kept:
        got = store.get(step)
        for k, v in expected[step].items():
            assert torch.equal(got[k], v), (step, k)
        if device != "cpu":
            on_device = store.get(step, device=device)
            assert on_device["weight"].device.type == "cuda"
            assert torch.equal(on_device["weight"].cpu(), expected[step]["weight"])
    return {"checked": kept}


SCENARIOS = {
    f.__name__: f
    for f in (round_trip, partial, capacity, bad_input, put, check, interactive, guarded)
}


def _dcp_scenario(name: str) -> Any:
    def run(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
        from . import _dcp  # torch.distributed only where a scenario needs it

        result: dict[str, Any] = getattr(_dcp, name)(store, rank, world, p)
        return result

    return run


SCENARIOS.update(
    {
        name: _dcp_scenario(name)
        for name in (
            "dcp_save",
            "dcp_load",
            "fsdp_save",
            "fsdp_load",
            "dcp_ids",
            "dcp_no_dist",
            "dcp_faulty",
            "dcp_sharded",
            "dcp_dtensor",
        )
    }
)


def main() -> None:
    spec = json.loads(sys.argv[1])
    with storage.connect(
        spec["job"],
        rank=spec["rank"],
        world_size=spec["world"],
        host=spec["host"],
        root=spec["root"],
        timeout=30,
    ) as store:
        result = SCENARIOS[spec["scenario"]](store, spec["rank"], spec["world"], spec["params"])
    print(json.dumps(result, default=str), flush=True)
    # The Store is closed and the result is out: leave without interpreter finalization. After a
    # gloo process group (the DCP scenarios) torch can abort there, "terminate called without an
    # active exception" (SIGABRT), with every step done, its group destroyed and this line
    # printed: gloo's threads still hold work whose tensors need the GIL while it is torn down
    # (pytorch/pytorch#179291). It did here in 2 of 20 FSDP loads beside a busy core.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
