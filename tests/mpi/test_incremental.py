"""Snapshots that cost what changed, end to end: real daemons, real shared memory, real MPI.

Four ranks on four virtual hosts, RS(3,1), ``--keep 2``: each rank's state is a large frozen
tensor and small adapters that change every step. Checked: later puts copy, encode and send
only the adapters; the base step stays (pinned) while kept steps refer to it and goes once
nothing does; memory counts it once; every kept step reads back bit-exact from every host,
after a host is lost and rebuilt, after a restart of the daemons and after a corrupted chunk of
the shared base is repaired (once, for every step); the persistent tier writes each step whole.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import storage
from bench.harness import Cluster, close_all
from storage.placement import Group, HostBlob, StripeLayout

WORLD = 4
FROZEN = 1 << 20  # floats per rank: 4 MiB
ADAPTER = 1 << 12


def _state(rank: int, step: int, frozen_seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + frozen_seed)
    frozen = torch.randn(FROZEN, generator=g)
    a = torch.randn(2, ADAPTER, generator=torch.Generator().manual_seed(1 + 97 * rank + step))
    return {"base": {"w": frozen}, "lora": {"a": a[0], "b": a[1]}, "step": step}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["base"]["w"], want["base"]["w"])
    assert torch.equal(got["lora"]["a"], want["lora"]["a"])
    assert torch.equal(got["lora"]["b"], want["lora"]["b"])


def _put(stores: list[storage.Store], step: int, states: dict[int, Any]) -> list[Any]:
    handles = [s.put(step, states[r]) for r, s in enumerate(stores)]
    for h in handles:
        h.wait(60)
    return handles


def _manifests(root: Path, job: str) -> dict[str, list[str]]:
    return {
        f"host{h}": sorted(p.name for p in (root / job / f"host{h}" / "steps").glob("*.json"))
        for h in range(4)
    }


def _check(c: Cluster, steps: list[int], states: dict[int, dict[int, Any]]) -> None:
    """Every rank of every step, read on every host (own and foreign: fetched)."""
    stores = c.stores(WORLD)
    try:
        for s in stores:
            assert set(steps) <= set(s.steps())  # (and steps on disk)
            for step in steps:
                for r in range(WORLD):
                    _same(s.get(step, rank=r), states[step][r])
    finally:
        close_all(stores)


def _chunks_of(root: Path, job: str, slot: int, step: int) -> int:
    """Data and parity chunks host ``slot`` holds of ``step`` (from its manifest)."""
    m = json.loads((root / job / f"host{slot}" / "steps" / f"{step}.json").read_text())
    cb = m["step_chunk_bytes"]
    blobs = [
        HostBlob(tuple((s["rank"], s["nbytes"]) for s in m["shards"] if s["slot"] == p), cb)
        for p in range(4)
    ]
    lay = StripeLayout(Group(0, (0, 1, 2, 3), 3, 1), [len(b.chunks) for b in blobs])
    return len(blobs[slot].chunks) + len(lay.parity_stripes[slot])


def _wait_on_disk(root: Path, job: str, step: int) -> Path:
    d = root / job / f"step-{step}"
    deadline = time.monotonic() + 60
    while not (d / "manifest.json").exists():
        assert time.monotonic() < deadline, f"step {step} never reached {root}"
        time.sleep(0.1)
    return d


def test_incremental_puts_share_pin_rebuild_and_persist(shm_root: Path, tmp_path: Path) -> None:
    disk = tmp_path / "persist"
    extra = ["--keep", "2", "--persist-dir", str(disk), "--persist-every", "3"]
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=extra)
    states: dict[int, dict[int, Any]] = {}
    stores: list[storage.Store] = []
    try:
        stores = c.stores(WORLD)
        encoded: list[float] = []
        sent: list[float] = []
        for step in range(1, 5):
            states[step] = {r: _state(r, step) for r in range(WORLD)}
            before = [s.info() for s in stores]
            handles = _put(stores, step, states[step])
            after = [s.info() for s in stores]
            encoded.append(
                sum(
                    a["stats"]["encode_bytes"] - b["stats"]["encode_bytes"]
                    for a, b in zip(after, before, strict=True)
                )
            )
            sent.append(
                sum(a["sent_bytes"] - b["sent_bytes"] for a, b in zip(after, before, strict=True))
            )
            if step == 1:
                assert all(h.plan.base is None for h in handles)
            else:
                # the frozen tensor is a reference to step 1: only the adapters were copied
                assert all(h.plan.base == 1 for h in handles), [h.plan.base for h in handles]
                assert all(h.plan.ref_bytes == FROZEN * 4 for h in handles)
                assert all(h.plan.own_bytes < 3 * ADAPTER * 4 for h in handles)
        # steps 2-4 encoded and sent a small fraction of step 1's bytes
        assert max(encoded[1:]) < 0.05 * encoded[0], encoded
        assert max(sent[1:]) < 0.05 * sent[0], sent
        # the daemons count what was copied and what was referred to
        infos = [s.info()["stats"] for s in stores]
        assert sum(i["referenced_bytes"] for i in infos) == 3 * WORLD * FROZEN * 4
        assert all(i["pinned_steps"] == 1 for i in infos)
        # --keep 2: steps 3 and 4 for readers; step 1 kept (pinned) for them, step 2 gone
        assert stores[0].steps() == [3, 4]
        assert all(
            m == ["1.json", "3.json", "4.json"] for m in _manifests(shm_root, c.job).values()
        )
        with pytest_raises_not_found():
            stores[0].get(1)
        # memory counts the shared bytes once: about one full step, not three
        held = sum(s.info()["data_bytes"] for s in stores[:1])  # every host reports its own
        one_full = FROZEN * 4 + 2 * ADAPTER * 4
        assert held < 1.2 * one_full, (held, one_full)
        # the persistent tier wrote step 3 whole: readable alone, without ecsnap
        d3 = _wait_on_disk(disk, c.job, 3)
        for r in range(WORLD):
            got = load_file(str(d3 / f"rank-{r}.safetensors"))
            assert torch.equal(got["base.w"], states[3][r]["base"]["w"])
            assert torch.equal(got["lora.a"], states[3][r]["lora"]["a"])
        close_all(stores)
        _check(c, [3, 4], states)
        # a restart of the daemons keeps the sharing; a lost host is rebuilt, its base once
        c.kill()
        c = c.relaunch()
        assert all(
            m == ["1.json", "3.json", "4.json"] for m in _manifests(shm_root, c.job).values()
        )
        _check(c, [3, 4], states)
        c.kill()
        shutil.rmtree(shm_root / c.job / "host1")
        c = c.relaunch()
        _check(c, [3, 4], states)
        stores = c.stores(WORLD)
        stats = stores[1].info()["stats"]
        # what host 1 lost, rebuilt once: step 1's shard (shared by steps 3 and 4, which hold
        # only their adapters) and the parity of the three
        assert stats["rebuilt_chunks"] == sum(
            _chunks_of(shm_root, c.job, 1, st) for st in (1, 3, 4)
        )
        # a corrupted chunk of the shared base: repaired once, then both steps read right
        m = json.loads((shm_root / c.job / "host2" / "steps" / "1.json").read_text())
        shard = next(s for s in m["shards"] if s["slot"] == 2)
        path = shm_root / c.job / "host2" / "data" / shard["buffer"]
        with path.open("r+b") as f:
            f.seek(1 << 20)
            b = f.read(1)
            f.seek(1 << 20)
            f.write(bytes([b[0] ^ 0x5A]))
        failures = stores[2].info()["stats"]["checksum_failures"]
        _same(stores[2].get(4), states[4][2])
        _same(stores[2].get(3), states[3][2])
        assert stores[2].info()["stats"]["checksum_failures"] == failures + 1
        # the frozen tensor changes: the next put is whole; step 1 goes once nothing refers to it
        for step in (5, 6):
            states[step] = {r: _state(r, step, frozen_seed=1) for r in range(WORLD)}
            handles = _put(stores, step, states[step])
        assert all(h.plan.base == 5 for h in handles)
        # a put returns once every host wrote its manifest and removed those of the steps that
        # retention dropped, and of the base they freed (the round after)
        assert all(m == ["5.json", "6.json"] for m in _manifests(shm_root, c.job).values())
        close_all(stores)
        _check(c, [5, 6], states)
    finally:
        close_all(stores)
        c.stop()


class pytest_raises_not_found:
    """``pytest.raises(StepNotFoundError)`` (a pinned step is gone for readers)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        assert kind is storage.StepNotFoundError, kind
        return True


@contextlib.contextmanager
def _two_trainers(root: Path) -> Iterator[tuple[Cluster, storage.Store, storage.Store, Any]]:
    """Two hosts, RS(1,1); two Stores of rank 0 (one on each host), the first having put step 1
    (a tensor ``x`` of 1 MiB)."""
    c = Cluster(root, hosts=2, k=1, m=1)
    stores: list[storage.Store] = []
    try:
        a, b = c.stores(1) + c.stores(1)
        stores = [a, b]
        x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
        a.put(1, {"w": x}).wait(60)
        yield c, a, b, x
    finally:
        close_all(stores)
        c.stop()


def test_a_base_deleted_or_put_again_is_never_misread(shm_root: Path) -> None:
    """A step that another Store deleted and put again with other bytes is not the base the
    trainer remembers (its table's digest differs): the next put is whole. A base deleted while a
    later step refers to it stays for that step (pinned), gone for readers."""
    with _two_trainers(shm_root) as (c, a, b, x):
        b.delete(1)
        b.put(1, {"w": torch.randn(1 << 18)}).wait(60)  # same shape, other bytes
        h = a.put(2, {"w": x, "a": torch.ones(8)})
        h.wait(60)
        assert h.plan.base is None  # the daemon refused the stale base: the shard is whole
        assert torch.equal(a.get(2)["w"], x)
        h = a.put(3, {"w": x, "a": torch.zeros(8)})
        h.wait(60)
        assert h.plan.base == 2 and h.plan.ref_bytes == x.nbytes
        a.delete(2)  # gone for readers, pinned for step 3
        assert a.steps() == [3]  # (step 1 went by retention, --keep 2)
        with pytest_raises_not_found():
            a.get(2)
        got = a.get(3)
        assert torch.equal(got["w"], x) and torch.equal(got["a"], torch.zeros(8))
        a.delete(3)  # nothing refers to step 2 any more: both go
        # a delete returns once every host removed its manifests (the round after it), and the
        # base freed in the same round went in that round's local work
        assert _manifests_of(shm_root, c.job, 2) == {"host0": [], "host1": []}


def _manifests_of(root: Path, job: str, hosts: int) -> dict[str, list[str]]:
    return {
        f"host{h}": sorted(p.name for p in (root / job / f"host{h}" / "steps").glob("*.json"))
        for h in range(hosts)
    }


def test_a_dry_alloc_keeps_the_base_it_names_until_its_trainer_goes(shm_root: Path) -> None:
    """A put with references names its likely base in its first request (the dry alloc, before
    the trainer hashes), so that the round keeping the base runs while it hashes: the daemons
    keep that base from then on, and let it go when the trainer goes away without putting."""
    with _two_trainers(shm_root) as (c, a, b, x):
        kept = a._kept[0]
        assert kept.likely_base(x.nbytes) == 1
        conn, _ = a._handshake()  # a trainer of its own, that goes after its dry alloc
        try:
            reply = conn.request(
                {
                    "op": "alloc",
                    "step": 2,
                    "rank": 0,
                    "world_size": 1,
                    "nbytes": 0,
                    "dry": True,
                    "base": 1,
                    "base_table": kept.table_of(1),
                }
            )
            assert reply is not None and reply.get("ok"), reply
            b.delete(1)  # gone for readers, kept for the put that named it
            assert b.steps() == []
            assert _manifests_of(shm_root, c.job, 2) == {"host0": ["1.json"], "host1": ["1.json"]}
        finally:
            conn.close()
        deadline = time.monotonic() + 30
        while _manifests_of(shm_root, c.job, 2) != {"host0": [], "host1": []}:
            assert time.monotonic() < deadline, "the base outlived the trainer that named it"
            time.sleep(0.05)
        h = a.put(2, {"w": x, "a": torch.ones(8)})  # its base is gone: the put is whole
        h.wait(60)
        assert h.plan.base is None and torch.equal(a.get(2)["w"], x)
