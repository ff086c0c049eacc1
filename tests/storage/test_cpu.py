"""CPU accounting by phase (storage.cpu): every CPU second in exactly one phase, the innermost."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from storage.cpu import PHASES, Clock, charged, process_seconds
from storage.state import copy_pieces


def _burn(seconds: float) -> None:
    """Spend about ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


def test_a_nested_phase_pauses_the_outer_one() -> None:
    clock = Clock()
    with clock.phase("rounds"):
        _burn(0.05)
        with clock.phase("encode"):
            _burn(0.1)
        _burn(0.05)
    t = clock.totals()
    assert t["encode"] == pytest.approx(0.1, abs=0.03)
    assert t["rounds"] == pytest.approx(0.1, abs=0.03)  # the inner 0.1 s is not counted twice
    assert all(t[p] == 0 for p in PHASES if p not in ("encode", "rounds", "other"))


def test_threads_are_charged_apart_and_sleep_costs_nothing() -> None:
    clock = Clock()

    def work(phase: str, seconds: float) -> None:
        with clock.phase(phase):
            _burn(seconds)
            time.sleep(0.1)  # waiting is not CPU

    threads = [
        threading.Thread(target=work, args=("checksum", 0.05)),
        threading.Thread(target=work, args=("send", 0.1)),
    ]
    for th in threads:
        th.start()
    with clock.phase("polling"):
        time.sleep(0.1)
    for th in threads:
        th.join()
    t = clock.totals()
    assert t["checksum"] == pytest.approx(0.05, abs=0.03)
    assert t["send"] == pytest.approx(0.1, abs=0.03)
    assert t["polling"] < 0.02


def test_other_is_the_process_time_no_phase_claimed_and_trainer_time_is_apart() -> None:
    clock = Clock()
    with clock.phase("encode"):
        _burn(0.05)
    clock.add("stage", 5.0)  # a trainer's, not this process's: not taken from "other"
    before = process_seconds()
    t = clock.totals()
    after = process_seconds()
    assert t["stage"] == 5.0
    mine = sum(v for p, v in t.items() if p not in ("stage", "hash"))
    assert before - 0.01 <= mine <= after + 0.01


def test_an_unknown_phase_is_refused() -> None:
    clock = Clock()
    with pytest.raises(ValueError, match="unknown CPU phase 'sending'"), clock.phase("sending"):
        pass
    with pytest.raises(ValueError, match="unknown CPU phase"):
        clock.add("nope", 1.0)


def test_a_charged_method_and_an_exception_inside_it() -> None:
    class Module:
        def __init__(self) -> None:
            self.host = self
            self.cpu = Clock()

        @charged("repair")
        def work(self, fail: bool) -> int:
            _burn(0.05)
            if fail:
                raise RuntimeError("boom")
            return 7

    m = Module()
    assert m.work(False) == 7
    with pytest.raises(RuntimeError):
        m.work(True)
    assert m.cpu.totals()["repair"] == pytest.approx(0.1, abs=0.04)
    with m.cpu.phase("rounds"):  # the stack is clean after the exception
        _burn(0.02)
    assert m.cpu.totals()["rounds"] == pytest.approx(0.02, abs=0.02)


def test_copies_report_their_cpu_time_from_every_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(96 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    dst[::4096] = 0  # faulted in: the copy alone is timed
    with ThreadPoolExecutor(2) as pool:
        both = threading.Barrier(2)
        list(pool.map(lambda _: both.wait(), range(2)))  # both threads started before the clock
        shares = []
        for _ in range(3):  # the best of three: whatever else the process did only adds to used
            dst[:] = 0
            t0, mine0 = process_seconds(), time.thread_time()
            seconds = copy_pieces([(dst, src)], pool)
            used, mine = process_seconds() - t0, time.thread_time() - mine0
            assert np.array_equal(dst, src)
            assert 0 < seconds <= used + 0.01
            assert mine < 0.5 * seconds  # the caller only waited: the copying was the pool's
            shares.append(seconds / used)
    assert max(shares) > 0.5  # and the pool threads' time is what is counted


def test_flush_shows_a_running_phase_before_it_ends() -> None:
    """The warmer's thread is in ``warm`` for its whole life: it flushes between pieces."""
    clock = Clock()
    t0 = time.thread_time()
    with clock.phase("warm"):
        _burn(0.05)
        clock.flush()
        seen = clock.totals()["warm"]
        assert seen >= 0.04
        _burn(0.05)
    spent = time.thread_time() - t0  # 0.1 s and more: a VM's clock once jumped 0.11 s in here
    assert spent >= 0.1
    # charged once, not twice: flushing again at the end would add the first 0.05 s again
    assert clock.totals()["warm"] == pytest.approx(spent, abs=0.01)
    clock.flush()  # no phase running: nothing to do
