from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from bench.harness import DTYPES, assert_same, make_state
from storage.errors import UnsupportedTypeError
from storage.state import ALIGN, flatten, stage, unflatten_views


def round_trip(state, pool=None):
    skeleton, leaves, nbytes = flatten(state)
    buf = np.zeros(nbytes, dtype=np.uint8)
    stage(leaves, buf, pool)
    # the skeleton and leaf metadata travel as JSON: nothing else may be needed to rebuild
    meta = json.loads(json.dumps({"s": skeleton, "l": [leaf.meta() for leaf in leaves]}))
    return unflatten_views(meta["s"], meta["l"], buf), leaves


def test_mixed_state_bit_exact() -> None:
    state = make_state(3, 4, every_kind=True)
    out, leaves = round_trip(state)
    assert_same(out, state)
    assert all(leaf.offset % ALIGN == 0 for leaf in leaves)


def test_big_state_with_two_threads() -> None:
    state = {"a": torch.randn(3000, 3000), "b": torch.randn(17, 1000).to(torch.bfloat16)}
    with ThreadPoolExecutor(2) as pool:
        out, _ = round_trip(state, pool)
    assert_same(out, state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3181,), (5, 0, 2), (7, 11)])
def test_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 50).to(dtype) if dtype != torch.bool else torch.randn(shape) > 0
    out, _ = round_trip({"t": t})
    assert_same(out, {"t": t})


def test_noncontiguous_tensors_come_back_contiguous_and_apart_from_the_source() -> None:
    base = torch.arange(60.0).reshape(6, 10)
    state = {
        "t": base.t(),
        "s": base[::2, 1::3],
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
    }
    out, _ = round_trip(state)
    assert torch.equal(out["t"], state["t"]) and out["t"].is_contiguous()
    assert torch.equal(out["s"], state["s"])
    assert torch.equal(out["conj"], state["conj"].resolve_conj())
    out["t"][0, 0] = -1
    assert base[0, 0] == 0  # views of the shard, not of anything the caller holds


def test_requires_grad_kept() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    out, _ = round_trip({"p": p})
    assert out["p"].requires_grad and torch.equal(out["p"], p.detach())


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"a": {"b": [1, object()]}}, "['a']['b'][1]"),
        ({"lock": threading.Lock()}, "['lock']"),
        ({"arr": np.array([object()])}, "['arr']"),
        ({"sparse": torch.eye(3).to_sparse()}, "['sparse']"),
        ({"set": {1, 2}}, "['set']"),
        ({(1, object()): 2}, ""),
        (lambda: 0, "state"),
    ],
)
def test_unsupported_types_name_their_path(state: object, path: str) -> None:
    with pytest.raises(UnsupportedTypeError) as info:
        flatten(state)
    assert isinstance(info.value, TypeError)
    if path:
        assert info.value.path == path
