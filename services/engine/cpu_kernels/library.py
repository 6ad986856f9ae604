"""Builds ``kernels.c`` on first use and binds it with ctypes.

The library is compiled for the machine it runs on (``-O3 -march=native``: AVX2 + FMA paths
where the CPU has them, portable C elsewhere) into ``$PDSERVE_CACHE_DIR/kernels/``, keyed by
the source, the compiler and the CPU, and renamed into place so concurrent replicas never load
half a file. No compiler (or a failed build) is not fatal: ``load()`` returns None with the
reason in ``load_error()``, and callers fall back to torch's kernels or refuse by name.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from services import env

ABI = 15
_SOURCE = Path(__file__).with_name("kernels.c")
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "pdserve_kernels_abi": [],
    "pdserve_kernels_simd": [],
    "pdserve_q4_gemm": [_P, _I, _I, _P, _P, _P, _I, _P],
    "pdserve_q8_gemm": [_P, _I, _I, _P, _P, _I, _P],
    "pdserve_add_rms_norm": [_P, _I, _P, _P, _I, _I, _F, _P, _I, _P],
    "pdserve_rope_and_cache": [_P, _L, _P, _L, _P, _L, _I, _I, _I, _I]
    + [_P, _P, _P, _P, _P, _L, _P, _I],
    "pdserve_silu_and_mul": [_P, _I, _I, _P],
    "pdserve_silu_and_mul_bf16": [_P, _I, _I, _P],
    "pdserve_decode_attention": [_P, _P, _P, _L, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P]
    + [_I],
    "pdserve_prompt_attention_scratch": [_I, _I, _I, _I],
    "pdserve_prompt_attention": [_P, _P, _P, _L, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I],
    "pdserve_decode_step": [_P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P],
    "pdserve_write_blocks": [_P, _L, _I, _I, _I, _I, _L, _P, _P, _P, _L],
}
_RESULTS = {
    "pdserve_kernels_abi": _I,
    "pdserve_kernels_simd": _I,
    "pdserve_prompt_attention_scratch": _L,
}
_lock = threading.Lock()
_state: dict[str, object] = {}


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo's ``flags`` line), read once per process."""
    try:
        return next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


def _build(cc: str, flags: tuple[str, ...] = (), root: Path | None = None) -> Path:
    """``flags``: extra compiler flags (tests build the narrower SIMD paths with them, under
    a ``root`` of their own; None: ``PDSERVE_CACHE_DIR``)."""
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + cc.encode() + cpu_flags().encode() + " ".join(flags).encode())
    key = key.hexdigest()[:16]
    out = (root or Path(env.CACHE_DIR.get())) / "kernels" / f"pdserve_kernels-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        # NOTE: -ffp-contract=off: a * b + c rounds twice, as in torch's reference ops
        cmd = [cc, "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared"]
        cmd += [*flags, str(_SOURCE), "-o", tmp, "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-800:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = _RESULTS.get(name)
    if lib.pdserve_kernels_abi() != ABI:
        raise OSError("stale kernels library (ABI mismatch)")
    return lib


def compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load() -> ctypes.CDLL | None:
    """The kernels library, built if needed; None if this machine cannot build it."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        try:
            cc = compiler()
            if cc is None:
                raise OSError("no C compiler on PATH (install gcc)")
            lib = bind(_build(cc))
        except (OSError, subprocess.SubprocessError) as e:
            _state["error"] = f"pdserve CPU kernels unavailable: {e}"
            lib = None
        _state["lib"] = lib
        return lib


def load_error() -> str | None:
    load()
    return _state.get("error")  # type: ignore[return-value]


def simd_level() -> str:
    """The quantized linears' path compiled in: ``avx512-vnni``, ``avx2`` (AVX2 + FMA) or
    ``portable``."""
    lib = load()
    levels = {3: "avx512-vnni", 2: "avx2"}
    return "none" if lib is None else levels.get(lib.pdserve_kernels_simd(), "portable")
