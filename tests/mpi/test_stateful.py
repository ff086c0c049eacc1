"""A model (steps -> what was put) against the real store, driven by Hypothesis: puts, gets,
deletes, duplicate puts, puts of deleted, evicted and older numbers, the daemons SIGKILLed and
relaunched (also in the middle of a put), a host wiped, a chunk file corrupted. On 8 and 12
virtual hosts (two RS(3,1) groups, three RS(2,2) groups). After every rule the store must agree
with the model, bit for bit: every step a rank saw protected, or a newer one, reads back; nothing
reads back that no rank put."""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import storage
from bench.harness import Cluster, make_state, same

KEEP = 4  # retention: the KEEP newest protected steps stay


def _state(rank: int, step: int, version: int) -> dict[str, object]:
    """What ``rank`` puts at ``step`` the ``version``-th time that number is put."""
    return make_state(rank, step * 100 + version)


class StoreMachine(RuleBasedStateMachine):
    root: Path
    hosts: int
    k: int
    m: int

    def __init__(self) -> None:
        super().__init__()
        self.cluster = Cluster(
            self.root,
            hosts=self.hosts,
            k=self.k,
            m=self.m,
            extra=["--chunk-bytes", "65536", "--keep", str(KEEP)],
            peer_timeout=6.0,
        )
        self.stores = self.cluster.stores(self.hosts, timeout=5.0)
        self.version: dict[int, int] = {}  # step -> how many times its number was put
        self.model: set[int] = set()  # protected steps the store must hold
        # a chunk corrupted since the last relaunch: one more fault in its stripe would be
        # beyond m=1, so wipes and further corruption wait for a relaunch to repair it
        self.dirty = False

    def teardown(self) -> None:
        self._close()
        assert self.cluster.stop() == 0, self.cluster.log.read_text()
        shutil.rmtree(self.root / self.cluster.job, ignore_errors=True)

    def _close(self) -> None:
        for s in self.stores:
            s.close()

    def _kill(self) -> None:
        self._close()
        self.cluster.kill()

    def _relaunch(self) -> None:
        self.cluster = self.cluster.relaunch()
        self.stores = self.cluster.stores(self.hosts, timeout=5.0)
        self.dirty = False  # adoption checked every chunk and repaired what was bad

    def _refused(self, step: int) -> bool:
        """Steps are write-once and go forward: a held number, or one older than the newest."""
        return step in self.model or (bool(self.model) and step < max(self.model))

    def _protect(self, step: int) -> None:
        self.model.add(step)
        self.model = set(sorted(self.model)[-KEEP:])  # retention keeps the KEEP newest steps

    @rule(step=st.integers(1, 40))
    def put(self, step: int) -> None:
        if self._refused(step):
            try:
                self.stores[0].put(step, _state(0, step, 9)).protected.result(30)
            except storage.StepExistsError:
                return
            raise AssertionError(f"a put of step {step} was accepted; the store holds {self.model}")
        self.version[step] = self.version.get(step, 0) + 1  # a deleted number: put afresh
        v = self.version[step]
        handles = [s.put(step, _state(r, step, v)) for r, s in enumerate(self.stores)]
        for h in handles:
            h.wait(60)
        self._protect(step)

    @rule(step=st.integers(1, 40), delay=st.floats(0.0, 0.3))
    def put_and_kill(self, step: int, delay: float) -> None:
        """The whole job SIGKILLed while every rank puts ``step``, at any point of its rounds."""
        if self._refused(step):
            return
        self.version[step] = self.version.get(step, 0) + 1
        v = self.version[step]
        timer = threading.Timer(delay, self.cluster.kill)
        timer.start()
        try:
            handles = [s.put(step, _state(r, step, v)) for r, s in enumerate(self.stores)]
            for h in handles:
                h.wait(20)
        except (storage.StorageError, TimeoutError, OSError):
            pass
        timer.join()
        self._kill()
        self._relaunch()
        held = set(self.stores[0].steps())
        if step in held:  # the commit was decided before the kill: retention with it
            self._protect(step)
        assert held == self.model, f"after a kill mid-put of {step}: {held}, not {self.model}"

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.model)))
        rank = data.draw(st.integers(0, self.hosts - 1))
        reader = data.draw(st.integers(0, self.hosts - 1))  # any host may read any rank
        got = self.stores[reader].get(step, rank=rank)
        assert same(got, _state(rank, step, self.version[step])), (step, rank, reader)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.model)))
        self.stores[0].delete(step)
        self.model.discard(step)

    @rule()
    def kill_and_relaunch(self) -> None:
        self._kill()
        self._relaunch()

    @precondition(lambda self: not self.dirty)
    @rule(host=st.integers(0, 11))
    def wipe_host_and_relaunch(self, host: int) -> None:
        host %= self.hosts
        self._kill()
        shutil.rmtree(self.root / self.cluster.job / f"host{host}")
        self._relaunch()

    @precondition(lambda self: bool(self.model) and not self.dirty)
    @rule(host=st.integers(0, 11), seed=st.integers(0, 1 << 16))
    def corrupt_a_chunk_file(self, host: int, seed: int) -> None:
        host %= self.hosts
        rng = random.Random(seed)
        d = self.root / self.cluster.job / f"host{host}"
        files = sorted((d / "data").glob("r*")) + sorted((d / "parity").glob("p*"))
        if files:
            f = rng.choice(files)
            raw = bytearray(f.read_bytes())
            if raw:
                raw[rng.randrange(len(raw))] ^= 0x40
                f.write_bytes(bytes(raw))
                self.dirty = True

    @invariant()
    def steps_agree(self) -> None:
        held = [s.steps() for s in self.stores]
        assert held == [sorted(self.model)] * self.hosts, held


@pytest.mark.parametrize(("hosts", "k", "m"), [(8, 3, 1), (12, 2, 2)], ids=["8h", "12h"])
def test_store_against_model(shm_root: Path, hosts: int, k: int, m: int) -> None:
    StoreMachine.root = shm_root
    StoreMachine.hosts, StoreMachine.k, StoreMachine.m = hosts, k, m
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=2,
            stateful_step_count=12,
            deadline=None,
            database=None,
            # no shrinking: replaying against a real system is slow and its timing is not data
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
