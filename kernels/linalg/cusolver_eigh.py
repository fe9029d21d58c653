"""Batched symmetric eigenvalues on CUDA through cuSOLVER's cusolverDnXsyevBatched, called with ctypes.

torch.linalg.eigh sends batches of matrices larger than 32 x 32 through a per-matrix loop (hundreds of
times slower); cuSOLVER >= 11.7 (CUDA 12.6) has a truly batched solver for any size. We call it on the
library torch already loaded, so nothing is compiled. `available()` says whether it can be used here.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading

import torch

_CUDA_R_32F, _CUDA_R_64F = 0, 1
_EIG_MODE_NOVECTOR, _EIG_MODE_VECTOR = 0, 1
_FILL_MODE_LOWER = 0
_DTYPES = {torch.float32: _CUDA_R_32F, torch.float64: _CUDA_R_64F}


class CusolverError(RuntimeError):
    """cuSOLVER could not be loaded or returned an error status."""


def _candidate_paths() -> list[str]:
    """libcusolver files: the one this process already mapped first, then the nvidia wheels, then ldconfig."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            paths += [line.split()[-1] for line in maps if "libcusolver.so" in line]
    except OSError:
        pass
    for root in sys.path:
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcusolver.so*"), recursive=True))
    paths += ["libcusolver.so", "libcusolver.so.12", "libcusolver.so.11"]
    return list(dict.fromkeys(paths))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise CusolverError("no CUDA device: cusolverDnXsyevBatched needs one")
    # torch loads its CUDA linear-algebra library (and cuSOLVER with it) lazily: make it do so now.
    torch.linalg.eigvalsh(torch.eye(2, device="cuda"))
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "cusolverDnXsyevBatched"):
            _declare(lib)
            return lib
    raise CusolverError("no libcusolver with cusolverDnXsyevBatched (needs CUDA >= 12.6) was found")


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t
    lib.cusolverDnCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cusolverDnSetStream.argtypes = [vp, vp]
    lib.cusolverDnCreateParams.argtypes = [ctypes.POINTER(vp)]
    lib.cusolverDnXsyevBatched_bufferSize.argtypes = [
        vp,
        vp,
        i32,
        i32,
        i64,
        i32,
        vp,
        i64,
        i32,
        vp,
        i32,
        ctypes.POINTER(sz),
        ctypes.POINTER(sz),
        i64,
    ]
    lib.cusolverDnXsyevBatched.argtypes = [vp, vp, i32, i32, i64, i32, vp, i64, i32, vp, i32, vp, sz, vp, sz, vp, i64]
    for name in (
        "cusolverDnCreate",
        "cusolverDnSetStream",
        "cusolverDnCreateParams",
        "cusolverDnXsyevBatched_bufferSize",
        "cusolverDnXsyevBatched",
    ):
        getattr(lib, name).restype = i32


_local = threading.local()


def _handle(lib: ctypes.CDLL, device: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
    """One (handle, params) per thread and device, created on first use."""
    cache = getattr(_local, "handles", None)
    if cache is None:
        cache = _local.handles = {}
    if device not in cache:
        handle, params = ctypes.c_void_p(), ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.cusolverDnCreate(ctypes.byref(handle)), "cusolverDnCreate")
            _check(lib.cusolverDnCreateParams(ctypes.byref(params)), "cusolverDnCreateParams")
        cache[device] = (handle, params)
    return cache[device]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CusolverError(f"{what} failed with cusolverStatus {status}")


def available() -> bool:
    """True where a CUDA device and a cuSOLVER with cusolverDnXsyevBatched are present."""
    try:
        _library()
        return True
    except (CusolverError, RuntimeError):
        return False


def batched_eigh(a: torch.Tensor, vectors: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigenvalues (ascending) [..., n] and, if asked, eigenvectors [..., n, n] (columns) of symmetric a.

    a: CUDA float32/float64 [..., n, n]; only its lower triangle is read.
    """
    if not a.is_cuda or a.dtype not in _DTYPES:
        raise ValueError(f"batched_eigh needs a CUDA float32/float64 tensor, got {a.dtype} on {a.device}")
    lib = _library()
    n = a.shape[-1]
    batch = a.numel() // (n * n) if a.numel() else 0
    # cuSOLVER is column-major and overwrites its input: for symmetric a the row-major copy is the same.
    work_a = a.reshape(batch, n, n).contiguous().clone()
    w = torch.empty(batch, n, dtype=a.dtype, device=a.device)
    if batch == 0:
        return w.reshape(a.shape[:-1]), (work_a.reshape(a.shape) if vectors else None)
    info = torch.zeros(batch, dtype=torch.int32, device=a.device)
    handle, params = _handle(lib, a.device.index or 0)
    _check(
        lib.cusolverDnSetStream(handle, ctypes.c_void_p(torch.cuda.current_stream(a.device).cuda_stream)),
        "cusolverDnSetStream",
    )
    dt = _DTYPES[a.dtype]
    mode = _EIG_MODE_VECTOR if vectors else _EIG_MODE_NOVECTOR
    dev_bytes, host_bytes = ctypes.c_size_t(), ctypes.c_size_t()
    _check(
        lib.cusolverDnXsyevBatched_bufferSize(
            handle,
            params,
            mode,
            _FILL_MODE_LOWER,
            n,
            dt,
            work_a.data_ptr(),
            n,
            dt,
            w.data_ptr(),
            dt,
            ctypes.byref(dev_bytes),
            ctypes.byref(host_bytes),
            batch,
        ),
        "cusolverDnXsyevBatched_bufferSize",
    )
    dev_work = torch.empty(max(dev_bytes.value, 1), dtype=torch.uint8, device=a.device)
    host_work = ctypes.create_string_buffer(max(host_bytes.value, 1))
    _check(
        lib.cusolverDnXsyevBatched(
            handle,
            params,
            mode,
            _FILL_MODE_LOWER,
            n,
            dt,
            work_a.data_ptr(),
            n,
            dt,
            w.data_ptr(),
            dt,
            dev_work.data_ptr(),
            dev_bytes.value,
            ctypes.addressof(host_work),
            host_bytes.value,
            info.data_ptr(),
            batch,
        ),
        "cusolverDnXsyevBatched",
    )
    if host_bytes.value:
        torch.cuda.current_stream(a.device).synchronize()  # host workspace must outlive the call
    vecs = work_a.transpose(-1, -2).reshape(a.shape) if vectors else None  # column-major -> row-major
    return w.reshape(a.shape[:-1]), vecs
