"""The ecsnap step a framework's checkpoint id names (DCP's ``checkpoint_id``, Lightning's and the
Hugging Face Trainer's checkpoint paths).

The rule: an int >= 0 is the step; a ``str`` or ``os.PathLike`` names the step its last path
component ends in, before an optional extension::

    120                           -> 120
    "/ckpt/run7/step-120"         -> 120        (torchtitan, DCP)
    "out/checkpoint-120/"         -> 120        (the Hugging Face Trainer)
    "ckpts/epoch=0-step=120.ckpt" -> 120        (Lightning's ModelCheckpoint)

Anything else (``"latest"``, ``"model.pt"``, a bool) is refused with an error that shows the
accepted forms. Nothing is read from or written to the path itself.
"""

from __future__ import annotations

import os
import re
from typing import Any

from storage.errors import StorageError
from storage.protocol import MAX_STEP

__all__ = ["FORMS", "step_of", "valid"]

FORMS = (
    "an int >= 0, or a path whose last component ends in the step "
    "(.../step-120, .../checkpoint-120, epoch=0-step=120.ckpt)"
)
_LAST = re.compile(r"(\d+)(?:\.[A-Za-z][A-Za-z0-9]*)?$")


def step_of(checkpoint_id: Any) -> int:
    """The step ``checkpoint_id`` names; :class:`StorageError` naming the accepted forms."""
    if isinstance(checkpoint_id, bool) or checkpoint_id is None:
        raise StorageError(f"checkpoint id {checkpoint_id!r} names no ecsnap step: give {FORMS}")
    step: int | None = None
    if isinstance(checkpoint_id, int):
        step = checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        path = os.fspath(checkpoint_id)
        text = path.decode(errors="replace") if isinstance(path, bytes) else path
        last = text.rstrip("/").rsplit("/", 1)[-1]
        found = _LAST.search(last)
        if found is not None:
            step = int(found.group(1))
    if step is not None:
        if not 0 <= step <= MAX_STEP:
            raise StorageError(
                f"checkpoint id {checkpoint_id!r}: steps are 0..{MAX_STEP} (2**63 - 1); "
                f"give {FORMS}"
            )
        return step
    raise StorageError(f"checkpoint id {checkpoint_id!r} names no ecsnap step: give {FORMS}")


def valid(checkpoint_id: Any) -> bool:
    """Whether ``checkpoint_id`` names a step (the frameworks' ``validate_checkpoint_id``)."""
    try:
        step_of(checkpoint_id)
    except StorageError:
        return False
    return True
