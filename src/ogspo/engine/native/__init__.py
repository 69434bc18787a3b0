"""The engine's own CPU kernels, compiled on first use: the small-row fp32 GEMM (`gemm.c`), its bf16
twin for CPUs with AVX512-BF16 (`gemm_bf16.c`: bf16 weights and inputs, fp32 sums and output), the
fused non-matmul work of a decoder layer (`ops.c`: residual + RMSNorm, rotary embedding + cache
write + tree attention, SiLU-gate), and a whole decoder layer chaining them in one call (`layer.c`).

The C sources are built with the machine's C compiler for the machine it runs on (`-march=native`,
so AVX-512 where the CPU has it, AVX2 otherwise; `OGSPO_NATIVE_MARCH=x86-64-v3` builds the AVX2
variant anywhere, which the tests use) into a per-user cache folder keyed by the source, the
compiler, the flags and the CPU flags, then loaded with ctypes. torch is imported first so the library's
OpenMP calls share the runtime (and thread pool) torch already loaded. Where no compiler is found
or the build fails, `load()` returns None and `unavailable_reason()` says why: the kernel is then
simply not a candidate of the kernel calibration (`ogspo.engine.kernels`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemm.c", "gemm_bf16.c", "ops.c", "layer.c"))
_CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
_state: dict = {}


def cache_root() -> Path:
    """ogspo's per-user cache folder: $OGSPO_CACHE, else $XDG_CACHE_HOME/ogspo or ~/.cache/ogspo."""
    return Path(os.environ.get("OGSPO_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                              "ogspo"))


def cache_dir() -> Path:
    return cache_root() / "native"


def source_texts() -> list[str]:
    """The C sources' texts (part of every cache key that depends on the kernels)."""
    return [s.read_text() for s in SOURCES]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    flags = [f"-march={os.environ.get('OGSPO_NATIVE_MARCH') or 'native'}", *_CFLAGS]
    key = hashlib.sha256("\n".join([*source_texts(), version, " ".join(flags), _cpu_flags()]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"libogspo_gemm-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            errors = ([ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.strip().splitlines()
                      or [str(proc.returncode)])
            raise RuntimeError(f"{cc} failed: {errors[0].strip()}")
        os.replace(tmp, lib)  # concurrent builders write the same bytes; the last rename wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load():
    """The loaded library (ctypes.CDLL), or None when it cannot be built here."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if cc is None:
            raise RuntimeError("no C compiler (cc or gcc) on PATH")
        lib = ctypes.CDLL(str(_build(cc)))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.ogspo_pack.argtypes = [ptr, i64, i64, ptr]
        lib.ogspo_pack.restype = None
        lib.ogspo_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
        lib.ogspo_gemm.restype = None
        lib.ogspo_pack_bf16.argtypes = [ptr, i64, i64, ptr]
        lib.ogspo_pack_bf16.restype = None
        lib.ogspo_gemm_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
        lib.ogspo_gemm_bf16.restype = ctypes.c_int  # 0, or 1: out of memory
        f32 = ctypes.c_float
        lib.ogspo_add_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
        lib.ogspo_add_rmsnorm.restype = None
        lib.ogspo_silu_mul.argtypes = [ptr, ptr, i64, i64]
        lib.ogspo_silu_mul.restype = None
        lib.ogspo_rope_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, ptr,
                                             ctypes.c_int]
        lib.ogspo_rope_attention.restype = ctypes.c_int  # a status code (ROPE_ATTENTION_ERRORS)
        lib.ogspo_decoder_layer.argtypes = [ptr, i64, i64, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr,
                                            ptr,
                                            ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr]
        lib.ogspo_decoder_layer.restype = ctypes.c_int  # 0 or a ROPE_ATTENTION_ERRORS code
        _state["reason"] = None
        _state["vector_width"] = lib.ogspo_vector_width()
        assert lib.ogspo_ops_vector_width() == _state["vector_width"]
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        lib = None
        _state["reason"] = str(err)
    _state["lib"] = lib
    return lib


# ogspo_rope_attention's status codes (ops.c), as the one-line error each raises
ROPE_ATTENTION_ERRORS = {
    1: "native attention: row count, heads or head dimension out of range",
    2: "native attention: the new rows do not fit the cache (need committed <= start and start + m <= cache rows)",
    3: "native attention: a position outside the rotary table (longer than the model's max_len?)",
    4: "native attention: out of memory",
}


def vector_width() -> int | None:
    """Floats per vector register of the loaded build (16: AVX-512, 8: AVX2), None if unavailable."""
    load()
    return _state.get("vector_width")


NO_BF16 = "OGSPO_NO_BF16"  # set to 1: act as if the CPU had no bf16 kernel (the fp32 path, for tests)


def bf16_available() -> bool:
    """Whether the loaded build has the AVX512-BF16 GEMM (the compiler targeted a CPU with avx512_bf16)
    and $OGSPO_NO_BF16 does not switch it off."""
    lib = load()
    return lib is not None and bool(lib.ogspo_bf16_available()) and os.environ.get(NO_BF16, "") in ("", "0")


def unavailable_reason() -> str | None:
    load()
    return _state["reason"]


class PackedWeight:
    """A weight W [out, in] (fp32 or bf16, CPU) packed into its kernel's panel layout; `matmul` takes
    fp32 rows and returns fp32 (a bf16 weight's kernel rounds the rows to bf16 and sums in fp32)."""

    def __init__(self, w: torch.Tensor):
        lib = load()
        if lib is None:
            raise RuntimeError(f"native kernel unavailable: {unavailable_reason()}")
        if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu" or w.dim() != 2:
            raise ValueError(f"native kernel packs 2-D fp32 or bf16 CPU weights, got {tuple(w.shape)} {w.dtype} on {w.device}")
        if w.dtype == torch.bfloat16 and not bf16_available():
            raise RuntimeError(f"native bf16 kernel unavailable: the CPU lacks avx512_bf16 (or ${NO_BF16} is set)")
        w = w.contiguous()
        self.dtype = w.dtype
        self.out_features, self.in_features = w.shape
        bf16 = w.dtype == torch.bfloat16
        pw = lib.ogspo_panel_width_bf16() if bf16 else lib.ogspo_panel_width()
        panels = -(-self.out_features // pw)
        depth = 2 * (-(-self.in_features // 2)) if bf16 else self.in_features  # bf16: inputs in pairs
        n = panels * depth * pw
        self.data = torch.empty(n + 32, dtype=w.dtype, device="cpu")  # +32: room to align
        offset = ((-self.data.data_ptr()) % 64) // self.data.element_size()  # elements to the next 64-byte boundary
        self.data = self.data[offset : offset + n]
        (lib.ogspo_pack_bf16 if bf16 else lib.ogspo_pack)(w.data_ptr(), self.out_features, self.in_features, self.data.data_ptr())
        self._gemm = lib.ogspo_gemm_bf16 if bf16 else lib.ogspo_gemm

    def matmul(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [..., in] fp32 -> [..., out] fp32."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"native matmul takes fp32 CPU rows of {self.in_features}, got {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device="cpu")  # [rows, out]
        if self._gemm(x2.data_ptr(), x2.shape[0], self.in_features, self.data.data_ptr(), self.out_features, y.data_ptr(),
                      threads):
            raise MemoryError("native bf16 matmul: out of memory for the rows' bf16 copy")
        return y.view(*shape[:-1], self.out_features)
