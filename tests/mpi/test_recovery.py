"""The recovery playbook, in the spirit of SCR's: kill, wipe, corrupt, relaunch, read bit-exact.

Every read is compared bit for bit with the state that was put (regenerated from its seed).
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

import storage
from bench.harness import REPO, Cluster, assert_same, make_state
from storage.placement import Group, HostBlob, StripeLayout

from ._trainer import trainers

HOSTS = ["host0", "host1", "host2", "host3"]


def _manifest(root: Path, job: str, host: str, step: int) -> dict[str, Any]:
    return json.loads((root / job / host / "steps" / f"{step}.json").read_text())


def _flip(path: Path, offset: int = 4096 + 17) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _data_file(root: Path, job: str, host: str, step: int, rank: int) -> Path:
    m = _manifest(root, job, host, step)
    shard = next(s for s in m["shards"] if s["rank"] == rank)
    return root / job / host / "data" / shard["buffer"]


def _assert_data_crcs(root: Path, job: str, hosts: list[str], step: int) -> int:
    """Each host's manifest of ``step`` names the CRC of every data chunk of the group, and each
    is the CRC of that chunk's bytes in its host's data file (taken by the stripe's encoder, or
    with copies by the first copy holder, as the chunk arrived). Returns how many it checked."""
    checked = 0
    for host in hosts:
        m = _manifest(root, job, host, step)
        cb, slots = m["step_chunk_bytes"], m["groups"][m["group"]]["slots"]
        shards = {int(s["rank"]): s for s in m["shards"]}
        for slot in slots:
            mine = tuple((r, s["nbytes"]) for r, s in shards.items() if s["slot"] == slot)
            crcs = m["crc"][str(slot)]["data"]
            chunks = HostBlob(mine, cb).chunks
            assert len(crcs) == len(chunks), (host, slot, len(crcs), len(chunks))
            for c, ref in enumerate(chunks):
                path = root / job / m["hosts"][slot] / "data" / shards[ref.rank]["buffer"]
                with path.open("rb") as f:
                    f.seek(ref.offset)
                    assert zlib.crc32(f.read(ref.length)) == crcs[c], (host, slot, c)
                checked += 1
    return checked


def test_playbook_k3_m1(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        trainers(
            c,
            "put",
            world=4,
            per_host=1,
            params={"steps": [1, 2], "partial": [3], "partial_ranks": [0, 1]},
        )
        assert _assert_data_crcs(shm_root, c.job, HOSTS, 2) > 4 * 4
        # a trainer crash: a new process reads from its own host's memory, no network
        [r] = trainers(
            c, "check", world=4, per_host=1, only=[0], params={"steps": [2], "ranks": [0]}
        )
        assert r["errors"] == {} and r["steps"] == [1, 2]
        assert r["sent_delta"] == 0 and r["received_delta"] == 0
        # the daemons die (SIGKILL, the whole job) with step 3 half put
        c.kill()
        c = c.relaunch()
        [r] = trainers(c, "check", world=4, per_host=1, only=[0], params={"steps": [1, 2]})
        assert r["errors"] == {} and r["steps"] == [1, 2], r
        assert not (shm_root / c.job / "host0" / "steps" / "3.json").exists()
        # lose host1 whole; the relaunched job rebuilds it, then lose host2 of the same group
        for lost in ("host1", "host2"):
            c.kill()
            shutil.rmtree(shm_root / c.job / lost)
            c = c.relaunch()
            assert "rebuilt" in c.log.read_text()
            [r] = trainers(
                c,
                "check",
                world=4,
                per_host=1,
                only=[0],
                params={"steps": [1, 2]},
                hosts=[lost] * 4,
            )
            assert r["errors"] == {}, r
            assert r["info"]["health"] == "healthy"
            stats = r["info"]["stats"]
            assert stats["rebuilt_chunks"] > 0
            # a replacement's files were missing, not corrupted: counted apart
            assert stats["missing_chunks"] > 0 and stats["checksum_failures"] == 0, stats
        # a flipped byte in a data chunk, found by a read while serving, repaired from the group
        _flip(_data_file(shm_root, c.job, "host3", 2, 3))
        [r] = trainers(
            c,
            "check",
            world=4,
            per_host=1,
            only=[0],
            params={"steps": [2], "ranks": [3]},
            hosts=["host3"] * 4,
        )
        assert r["errors"] == {} and r["info"]["stats"]["checksum_failures"] >= 1, r
        # with the job down: a flipped parity byte, a truncated data file, a corrupted manifest
        c.kill()
        m = _manifest(shm_root, c.job, "host0", 2)
        _flip(shm_root / c.job / "host1" / "parity" / m["parity"]["1"], 100)
        data = _data_file(shm_root, c.job, "host2", 1, 2)
        with data.open("r+b") as f:
            f.truncate(1000)
        mpath = shm_root / c.job / "host0" / "steps" / "1.json"
        mpath.write_text(mpath.read_text().replace('"world_size":4', '"world_size":5'))
        c = c.relaunch()
        log = c.log.read_text()
        assert "fails its checksum" in log, log
        [r] = trainers(c, "check", world=4, per_host=1, only=[0], params={"steps": [1, 2]})
        assert r["errors"] == {}, r
        assert json.loads(mpath.read_text())["world_size"] == 4  # taken back from a peer
        # more than m=1 hosts of the group lost: a clear error naming them, no wrong bytes
        c.kill()
        shutil.rmtree(shm_root / c.job / "host0")
        shutil.rmtree(shm_root / c.job / "host3")
        c = c.relaunch()
        [r] = trainers(
            c, "check", world=4, per_host=1, only=[0], params={"steps": [2]}, hosts=["host1"] * 4
        )
        err = r["errors"]["2/0"]
        assert err["type"] == "unrecoverable", r
        assert sorted(err["lost_hosts"]) == ["host0", "host3"] and err["ranks"] == [0, 3]
        assert err["newest"] is None and r["steps"] == []
    finally:
        c.stop()


def test_playbook_k2_m2_two_losses_permuted_slots_new_host(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=2, m=2)
    try:
        trainers(c, "put", world=8, per_host=2, params={"steps": [5, 6]})
        assert _assert_data_crcs(shm_root, c.job, HOSTS, 6) > 4 * 4
        # two hosts of a k=2 m=2 group at once
        c.kill()
        shutil.rmtree(shm_root / c.job / "host0")
        shutil.rmtree(shm_root / c.job / "host2")
        c = c.relaunch()
        [r] = trainers(
            c, "check", world=8, per_host=2, only=[0], params={"steps": [5, 6]}, hosts=["host0"] * 8
        )
        assert r["errors"] == {}, r
        # the same hosts on other MPI ranks: each claims its own slot again
        c.kill()
        c = c.relaunch(host_names=["host3", "host2", "host1", "host0"])
        [r] = trainers(
            c, "check", world=8, per_host=2, only=[0], params={"steps": [5, 6]}, hosts=["host2"] * 8
        )
        assert r["errors"] == {} and r["info"]["slot"] == 2, r
        # a new, empty machine instead of host1: it takes host1's slot and rebuilds its shards
        c.kill()
        shutil.rmtree(shm_root / c.job / "host1")
        c = c.relaunch(host_names=["host0", "hostX", "host2", "host3"])
        [r] = trainers(
            c,
            "check",
            world=8,
            per_host=2,
            only=[0],
            params={"steps": [5, 6], "get_none": True},
            hosts=["hostX"] * 8,
        )
        assert r["errors"] == {} and r["info"]["slot"] == 1, r
        assert r["get_none"] == 6
    finally:
        c.stop()


def test_beyond_m_falls_back_to_newest_recoverable(shm_root: Path) -> None:
    """Corrupt one chunk of step 2 on two hosts of a stripe (m=1): step 2 is lost, step 1 is not."""
    c = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        trainers(c, "put", world=4, per_host=1, params={"steps": [1, 2]})
        c.kill()
        # the first data chunks of host1 and host2 both sit in stripe 0: two erasures, m=1
        lay = StripeLayout(Group(0, (0, 1, 2, 3), 3, 1), [1, 1, 1, 1])
        assert lay.data_stripes[1][0] == lay.data_stripes[2][0] == 0
        for host, rank in (("host1", 1), ("host2", 2)):
            _flip(_data_file(shm_root, c.job, host, 2, rank), 10)
        c = c.relaunch()
        [r] = trainers(
            c,
            "check",
            world=4,
            per_host=1,
            only=[0],
            params={"steps": [2], "get_none": True},
            hosts=["host3"] * 4,
        )
        err = r["errors"]["2/0"]
        assert err["type"] == "unrecoverable" and err["newest"] == 1, r
        assert sorted(err["lost_hosts"]) == ["host1", "host2"], r
        assert r["get_none"] == 1 and r["steps"] == [1]
    finally:
        c.stop()


def test_put_in_flight_fails_and_clients_reconnect(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=2, k=1, m=1)
    spec = {
        "scenario": "interactive",
        "job": c.job,
        "root": str(shm_root),
        "rank": 0,
        "world": 2,
        "host": "host0",
        "params": {},
    }
    helper = subprocess.Popen(
        [sys.executable, "-m", "tests.mpi._trainer", json.dumps(spec)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # rank 1 puts step 1 only, so step 1 is protected and step 2 stays in flight
        other = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.mpi._trainer",
                json.dumps(dict(spec, scenario="put", rank=1, host="host1", params={"steps": [1]})),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert other.wait(120) == 0, other.communicate()
        other.communicate()
        assert helper.stdout is not None and helper.stdin is not None
        assert helper.stdout.readline().strip() == "READY"
        c.kill()
        c = c.relaunch()
        helper.stdin.write("go\n")
        helper.stdin.flush()
        assert helper.stdout.readline().strip() == "AGAIN"
        c.kill()
        c = c.relaunch()
        helper.stdin.write("go\n")
        helper.stdin.flush()
        out, err = helper.communicate(timeout=120)
        assert helper.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["outcome"].startswith("failed"), result
        assert result["waited"] < 30, result
        assert result["steps"] == [1]
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.communicate()
        c.stop()


def test_replication_k1_keeps_copies_and_survives_m_losses(shm_root: Path) -> None:
    """RS(1, 2) is 3-way replication: each peer holds byte copies of a host's chunks, no encoding,
    and any two of the three hosts can be wiped."""
    cb = 65536
    c = Cluster(shm_root, hosts=3, k=1, m=2, extra=["--chunk-bytes", str(cb)])
    try:
        trainers(c, "put", world=6, per_host=2, params={"steps": [1, 2]})
        [r] = trainers(c, "check", world=6, per_host=2, only=[0], params={"steps": [2]})
        assert r["errors"] == {} and r["info"]["stats"]["encode_bytes"] == 0, r
        assert _assert_data_crcs(shm_root, c.job, HOSTS[:3], 2) > 3 * 3
        c.kill()
        m = _manifest(shm_root, c.job, "host0", 2)
        assert m["step_chunk_bytes"] == cb  # 2.7 MB blobs: cut no finer than --chunk-bytes
        shards = {int(s["rank"]): s for s in m["shards"]}
        blobs = [
            HostBlob(tuple((r, s["nbytes"]) for r, s in shards.items() if s["slot"] == p), cb)
            for p in range(3)
        ]
        lay = StripeLayout(Group(0, (0, 1, 2), 1, 2), [len(b.chunks) for b in blobs])
        copies = 0
        for p in range(3):
            parity = (shm_root / c.job / f"host{p}" / "parity" / m["parity"][str(p)]).read_bytes()
            for i, s in enumerate(lay.parity_stripes[p]):
                dpos, chunk = lay.data_position(s, 0), lay.data_chunk(s, 0)
                want = bytearray(cb)
                if chunk is not None:
                    ref = blobs[dpos].chunks[chunk]
                    path = shm_root / c.job / f"host{dpos}" / "data" / shards[ref.rank]["buffer"]
                    with path.open("rb") as f:
                        f.seek(ref.offset)
                        want[: ref.length] = f.read(ref.length)
                    copies += 1
                assert parity[i * cb : (i + 1) * cb] == bytes(want), (p, s)
        assert copies == 2 * sum(len(b.chunks) for b in blobs)  # every chunk on both peers
        for lost in ("host0", "host2"):
            shutil.rmtree(shm_root / c.job / lost)
        c = c.relaunch(extra=["--chunk-bytes", str(cb)])
        [r] = trainers(
            c, "check", world=6, per_host=2, only=[0], params={"steps": [1, 2]}, hosts=["host0"] * 6
        )
        assert r["errors"] == {} and r["steps"] == [1, 2], r
    finally:
        c.stop()


def _put_all(stores: list[storage.Store], step: int) -> None:
    handles = [s.put(step, make_state(s.rank, step, every_kind=True)) for s in stores]
    for h in handles:
        assert h.wait(60) == step


def test_views_outlive_a_second_get_and_a_daemon_restart(shm_root: Path) -> None:
    """A get's views never change while they live: not when another get of the same shard is
    dropped, and not after the daemons restart (the new ones never heard of the lease) and the
    step retires while new steps need memory (keep=2)."""
    c = Cluster(shm_root, hosts=2, k=1, m=1)
    stores = c.stores(2)
    try:
        _put_all(stores, 1)
        first, second = stores[0].get(1), stores[0].get(1)
        del first
        gc.collect()  # its lease goes back with the next request; second's must stay
        for step in (2, 3, 4):  # step 1 retires at 3; 4 takes a free buffer of its size
            _put_all(stores, step)
        assert stores[0].steps() == [3, 4]
        assert_same(second, make_state(0, 1, every_kind=True))
        held = stores[1].get(4)
        c.kill()
        c = c.relaunch()
        for step in (5, 6, 7):  # step 4 retires at 6; 7 takes memory again
            _put_all(stores, step)
        assert stores[1].steps() == [6, 7]
        assert_same(held, make_state(1, 4, every_kind=True))
    finally:
        for s in stores:
            s.close()
        c.stop()


@pytest.mark.parametrize(("hosts", "k", "m"), [(8, 3, 1), (12, 2, 2)], ids=["8h", "12h"])
def test_playbook_on_several_groups(shm_root: Path, hosts: int, k: int, m: int) -> None:
    """The playbook on two and three groups: the whole job killed mid-put, m hosts of every
    group lost at once and rebuilt, a corrupted chunk in one group, more than m hosts of one
    group lost (the error names that group's hosts and ranks)."""
    names = [f"host{i}" for i in range(hosts)]
    g = k + m
    c = Cluster(shm_root, hosts=hosts, k=k, m=m)
    try:
        params = {"steps": [1, 2], "partial": [3], "partial_ranks": [0, g]}
        trainers(c, "put", world=hosts, per_host=1, params=params)
        assert _assert_data_crcs(shm_root, c.job, names, 2) > 0
        c.kill()  # with step 3 half put, in two groups
        c = c.relaunch()
        # m hosts of every group lost at once: each group rebuilds its own
        c.kill()
        lost = [names[i * g + j] for i in range(hosts // g) for j in range(m)]
        for name in lost:
            shutil.rmtree(shm_root / c.job / name)
        c = c.relaunch()
        assert "rebuilt" in c.log.read_text()
        [r] = trainers(
            c, "check", world=hosts, per_host=1, only=[0], params={"steps": [1, 2]}, hosts=names
        )
        assert r["errors"] == {} and r["steps"] == [1, 2], r
        assert r["info"]["health"] == "healthy"
        # a flipped byte in the last group, found by a read from the first, repaired
        last = hosts - 1
        _flip(_data_file(shm_root, c.job, names[last], 2, last))
        [r] = trainers(
            c,
            "check",
            world=hosts,
            per_host=1,
            only=[0],
            params={"steps": [2], "ranks": [last]},
            hosts=names,
        )
        assert r["errors"] == {}, r
        # more than m hosts of the second group: its ranks are named, the others' groups hold
        c.kill()
        beyond = names[g : g + m + 1]
        for name in beyond:
            shutil.rmtree(shm_root / c.job / name)
        c = c.relaunch()
        [r] = trainers(
            c, "check", world=hosts, per_host=1, only=[0], params={"steps": [2]}, hosts=names
        )
        err = r["errors"][f"2/{g}"]
        assert err["type"] == "unrecoverable", r
        assert sorted(err["lost_hosts"]) == sorted(beyond), err
        assert set(err["ranks"]) <= set(range(g, 2 * g)) and g in err["ranks"], err
        assert r["steps"] == []
    finally:
        c.stop()
