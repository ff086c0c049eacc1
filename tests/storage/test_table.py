"""A shard's tensor table read back: what pack_table wrote, or an error naming the shard."""

from __future__ import annotations

import json

import pytest

from storage.errors import StorageError
from storage.table import pack_table, unpack_table


def test_what_pack_table_writes_unpacks() -> None:
    leaves = [{"k": "torch", "dt": "float32", "sh": [2], "o": 0, "n": 8}]
    raw = pack_table({"w": {"$leaf": 0}}, leaves, base=3)
    assert unpack_table(raw, "step 1 rank 0") == {
        "skeleton": {"w": {"$leaf": 0}},
        "leaves": leaves,
        "base": 3,
    }


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"\0" * 64, "does not parse"),
        (b"\xff\xfe{", "does not parse"),
        (b"{not json", "does not parse"),
        (b"[1, 2]", "is no object with a skeleton"),
        (json.dumps({"leaves": []}).encode(), "is no object with a skeleton"),
        (json.dumps({"skeleton": 0, "leaves": "x"}).encode(), "has leaves that are not each"),
        (json.dumps({"skeleton": 0, "leaves": [{"k": "torch"}]}).encode(), "{dt, k, n, o, sh}"),
    ],
)
def test_bytes_that_are_no_table_name_the_shard(raw: bytes, says: str) -> None:
    with pytest.raises(StorageError) as info:
        unpack_table(raw, "step 7 rank 2")
    assert str(info.value).startswith("step 7 rank 2: its tensor table ") and says in str(
        info.value
    )
    assert "put the step again" in str(info.value)
