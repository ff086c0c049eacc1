"""ctypes binding of the ISA-L erasure-code functions.

The PyPI ``isal`` package binds only compression and CRC; the ``ec_*`` and ``gf_*`` functions live
in the ISA-L shared library that the ``pyeclib`` wheel ships (``pyeclib.libs/libisal-*.so.2``). A
system ``libisal.so.2`` is the fallback, and ``ECSNAP_LIBISAL`` names a library explicitly.

Every function gets ``argtypes``: without them ctypes truncates 64-bit pointers to int.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from pathlib import Path

from codec.errors import LibraryNotFoundError

__all__ = ["IsaL", "library"]

_u8p = ctypes.POINTER(ctypes.c_ubyte)
_pp = ctypes.POINTER(ctypes.c_void_p)


def _candidates() -> list[str]:
    found: list[str] = []
    explicit = os.environ.get("ECSNAP_LIBISAL")
    if explicit:
        found.append(explicit)
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            libs = Path(location).parent / "pyeclib.libs"
            found.extend(sorted(glob.glob(str(libs / "libisal*.so*"))))
    system = ctypes.util.find_library("isal")
    found.extend([p for p in (system, "libisal.so.2") if p])
    return found


class IsaL:
    """The loaded library with typed function pointers; :func:`library` gives the shared one."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self.gf_gen_cauchy1_matrix = lib.gf_gen_cauchy1_matrix
        self.gf_gen_cauchy1_matrix.argtypes = [_u8p, ctypes.c_int, ctypes.c_int]
        self.gf_gen_cauchy1_matrix.restype = None
        self.gf_invert_matrix = lib.gf_invert_matrix
        self.gf_invert_matrix.argtypes = [_u8p, _u8p, ctypes.c_int]
        self.gf_invert_matrix.restype = ctypes.c_int
        self.ec_init_tables = lib.ec_init_tables
        self.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, _u8p, _u8p]
        self.ec_init_tables.restype = None
        self.ec_encode_data = lib.ec_encode_data
        self.ec_encode_data.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            _pp,
            _pp,
        ]
        self.ec_encode_data.restype = None
        # (len, k, rows, vec_i, g_tbls, data, coding): coding ^= g_tbls[vec_i] * data
        self.ec_encode_data_update = lib.ec_encode_data_update
        self.ec_encode_data_update.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            _pp,
        ]
        self.ec_encode_data_update.restype = None
        self.gf_mul = lib.gf_mul
        self.gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
        self.gf_mul.restype = ctypes.c_ubyte
        self.crc32_iscsi = lib.crc32_iscsi
        self.crc32_iscsi.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        self.crc32_iscsi.restype = ctypes.c_uint


_lock = threading.Lock()
_library: IsaL | None = None


def library() -> IsaL:
    """Load ISA-L once per process; raise :class:`LibraryNotFoundError` naming every place tried."""
    global _library
    with _lock:
        if _library is None:
            errors: list[str] = []
            for path in _candidates():
                try:
                    _library = IsaL(path)
                    break
                except (OSError, AttributeError) as exc:
                    errors.append(f"{path}: {exc}")
            else:
                raise LibraryNotFoundError(
                    "ISA-L not found: looked for the library shipped in the pyeclib wheel "
                    "(site-packages/pyeclib.libs/libisal*.so*) and for a system libisal.so.2. "
                    "Install it with `pip install pyeclib` or `apt-get install libisal2`, or set "
                    "ECSNAP_LIBISAL to its path. Tried: " + ("; ".join(errors) or "nothing found")
                )
        return _library
