"""llama.cpp as a peer: built once from a pinned source package, run as separate programs, its timings parsed.

llama.cpp ships inside the source distribution of ``llama-cpp-python`` (under vendor/llama.cpp), so a
pinned PyPI version names exact llama.cpp sources without reaching GitHub. The build goes to the user
cache and is reused; nothing of llama.cpp enters this repository.

Glossary:
  - tools: the llama.cpp programs used here: ``llama-completion`` (plain decoding), ``llama-speculative-simple``
    (a draft model proposes, the target verifies) and ``llama-quantize`` (writes the BF16 files).
  - decode tok/s: for ``llama-completion``, the "eval" line of its perf report: tokens after the first over the
    time after the prompt pass (as Saguaro's decode rate); for ``llama-speculative-simple``, its "decoded" line:
    every token over the time after the prompt pass (its first round also makes the first token).
  - prompt tok/s: the "prompt eval" line: the prompt's tokens over the time of the prompt pass (peer_prefill.py).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from saguaro.loading.paths import cache_root

VERSION = "0.3.36"  # llama-cpp-python source package: the llama.cpp it vendors is what gets built
PACKAGE = "llama-cpp-python"
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-quantize")
EXIT_NO_TOOLCHAIN = 3  # `saguaro bench peers` exit code when cmake or a compiler is missing


class ToolchainError(RuntimeError):
    """cmake or a C/C++ compiler is missing, so llama.cpp cannot be built."""


class PeerRunError(RuntimeError):
    """A llama.cpp program failed, or its output lacks the timing lines."""


@dataclass(frozen=True)
class Build:
    """Where one llama.cpp build lives: <cache>/peers/llama.cpp-<version>/{src,build,build.log}."""
    root: Path

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    def tool(self, name: str) -> Path:
        return self.build / "bin" / name

    def complete(self) -> bool:
        return all(self.tool(t).is_file() for t in TOOLS)


def build_location(version: str = VERSION) -> Build:
    return Build(cache_root() / "peers" / f"llama.cpp-{version}")


def missing_toolchain(which: Callable[[str], str | None] | None = None) -> list[str]:
    """What the build needs and this machine lacks: cmake, a C compiler, a C++ compiler."""
    which = which or shutil.which
    needs = {"cmake": ("cmake",), "a C compiler (cc, gcc or clang)": ("cc", "gcc", "clang"),
             "a C++ compiler (c++, g++ or clang++)": ("c++", "g++", "clang++")}
    return [what for what, names in needs.items() if not any(which(n) for n in names)]


def require_toolchain(which: Callable[[str], str | None] | None = None) -> None:
    missing = missing_toolchain(which)
    if missing:
        raise ToolchainError(
            f"cannot build llama.cpp: missing {', '.join(missing)}. Install them (Debian/Ubuntu: "
            "`apt-get install cmake build-essential`), or pass --only saguaro to run Saguaro's rows alone.")


# -- commands -----------------------------------------------------------------------------
def download_command(dest: Path, version: str = VERSION) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"{PACKAGE}=={version}", "-d", str(dest)]


def configure_command(build: Build) -> list[str]:
    """Release, tuned to this CPU (GGML_NATIVE), static, no network code, no tests/server."""
    return ["cmake", "-S", str(build.src), "-B", str(build.build), "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]


def compile_command(build: Build, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build.build), "-j", str(jobs), "--target", *TOOLS]


def niced(cmd: list[str]) -> list[str]:
    """A long build runs at low priority: the machine is shared."""
    return ["nice", "-n", "10", *cmd] if shutil.which("nice") else cmd


def quantize_command(build: Build, src: Path, dst: Path, ftype: str = "BF16") -> list[str]:
    """A Q4_K_M file rewritten as ``ftype``: every tensor dequantized (so the same weights Saguaro loads in
    bf16, since it dequantizes the same file)."""
    return [str(build.tool("llama-quantize")), "--allow-requantize", str(src), str(dst), ftype]


def completion_command(build: Build, model: Path, prompt_file: Path, max_tokens: int, threads: int,
                       context: int = 4096) -> list[str]:
    """Plain greedy decoding of one prompt file (already chat-templated; special tokens parsed), in a context of
    ``context`` tokens (llama-completion refuses a prompt longer than the context minus 4)."""
    return [str(build.tool("llama-completion")), "-m", str(model), "-f", str(prompt_file), "-n", str(max_tokens),
            "-t", str(threads), "-tb", str(threads), "-c", str(context), "--temp", "0", "--seed", "0", "-no-cnv",
            "--no-display-prompt"]


def speculative_command(build: Build, target: Path, draft: Path, prompt_file: Path, max_tokens: int,
                        threads: int, draft_max: int) -> list[str]:
    """Greedy speculative decoding: the draft proposes ``draft_max`` tokens a round (no probability cut-off),
    target and draft each on ``threads`` threads, taking turns."""
    return [str(build.tool("llama-speculative-simple")), "-m", str(target), "-md", str(draft),
            "-f", str(prompt_file), "-n", str(max_tokens), "-t", str(threads), "-tb", str(threads),
            "-td", str(threads), "-tbd", str(threads), "-c", "4096", "--temp", "0", "--seed", "0",
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0"]


# -- building ---------------------------------------------------------------------------------
def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise PeerRunError(f"{what} failed (exit {done.returncode}); the end of {log}:\n{tail}")


def _extract_vendor(archive: Path, dest: Path) -> None:
    """Unpack only <package>/vendor/llama.cpp/ of the sdist into ``dest``."""
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            head, sep, rest = m.name.partition("/vendor/llama.cpp/")
            if sep and "/" not in head and rest:
                m.name = rest
                members.append(m)
        if not members:
            raise PeerRunError(f"{archive.name} has no vendor/llama.cpp/")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # no links out of dest
        tar.extractall(dest, members=members, **safe)
    (dest / ".git").unlink(missing_ok=True)  # a submodule pointer to a directory the sdist lacks


def ensure_built(version: str = VERSION, jobs: int = 2, log: Callable[[str], None] = print) -> Build:
    """The cached build, made first if needed (download, unpack, configure, compile: many minutes on 2 cores)."""
    build = build_location(version)
    if build.complete():
        return build
    require_toolchain()
    build.root.mkdir(parents=True, exist_ok=True)
    if not (build.src / "CMakeLists.txt").is_file():
        download = build.root / "download"
        log(f"downloading the {PACKAGE}=={version} source package")
        _run_logged(download_command(download, version), build.log, "pip download")
        archive = next(download.glob(f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"), None) or \
            next(download.glob("*.tar.gz"))
        shutil.rmtree(build.src, ignore_errors=True)
        _extract_vendor(archive, build.src)
    log(f"building llama.cpp into {build.build} ({jobs} jobs, niced; log: {build.log})")
    _run_logged(niced(configure_command(build)), build.log, "cmake configure")
    _run_logged(niced(compile_command(build, jobs)), build.log, "cmake build")
    if not build.complete():
        raise PeerRunError(f"the build finished without {', '.join(t for t in TOOLS if not build.tool(t).is_file())}")
    return build


# -- parsing ----------------------------------------------------------------------------------
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
# log lines may carry a time stamp and a level ("0.08.894.179 I common_perf_print: ...")
_EVAL = re.compile(rf"(?<!prompt )\beval time =\s*{_NUM} ms /\s*(\d+) (?:runs|tokens)")
_PROMPT = re.compile(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_COUNTER = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)


@dataclass
class PeerTiming:
    """What one llama.cpp run reports about itself."""
    tok_s: float  # decode tokens per second (see the module glossary)
    decode_tokens: int
    decode_s: float
    prompt_tokens: int | None = None
    drafted: int | None = None  # speculative runs only
    accepted: int | None = None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def parse_completion(log: str) -> PeerTiming:
    """The target's perf report of ``llama-completion``: the generation "eval time" line (not "prompt eval")."""
    evals = _EVAL.findall(log)
    if not evals:
        raise PeerRunError("no 'eval time' line in llama-completion's output")
    ms, runs = float(evals[-1][0]), int(evals[-1][1])
    prompt = _PROMPT.findall(log)
    return PeerTiming(tok_s=runs / (ms / 1e3) if ms > 0 else 0.0, decode_tokens=runs, decode_s=ms / 1e3,
                      prompt_tokens=int(prompt[-1][1]) if prompt else None)


@dataclass(frozen=True)
class PromptEval:
    """llama.cpp's prompt pass, as its "prompt eval time = T ms / N tokens" line reports it."""
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def parse_prompt_eval(log: str) -> PromptEval:
    """The last "prompt eval time" line of a perf report (``llama-completion`` prints the target's)."""
    found = _PROMPT.findall(log)
    if not found:
        raise PeerRunError("no 'prompt eval time' line in llama.cpp's output")
    return PromptEval(tokens=int(found[-1][1]), seconds=float(found[-1][0]) / 1e3)


def parse_speculative(log: str) -> PeerTiming:
    """``llama-speculative-simple``'s summary: the "decoded" line and the draft counters."""
    decoded = _DECODED.search(log)
    if decoded is None:
        raise PeerRunError("no 'decoded N tokens' line in llama-speculative-simple's output")
    counters = dict(_COUNTER.findall(log))
    encoded = _ENCODED.search(log)
    return PeerTiming(tok_s=float(decoded.group(3)), decode_tokens=int(decoded.group(1)),
                      decode_s=float(decoded.group(2)),
                      prompt_tokens=int(encoded.group(1)) if encoded else None,
                      drafted=int(counters["n_drafted"]) if "n_drafted" in counters else None,
                      accepted=int(counters["n_accept"]) if "n_accept" in counters else None)


def run_tool(cmd: list[str], timeout_s: float, cores: list[int] | None = None) -> tuple[str, str]:
    """(stdout, stderr) of one llama.cpp program, pinned to ``cores`` if given; a failure or a hang raises
    PeerRunError."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores and hasattr(os, "sched_setaffinity") else None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              stdin=subprocess.DEVNULL, preexec_fn=pin)
    except subprocess.TimeoutExpired:
        raise PeerRunError(f"{Path(cmd[0]).name} ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise PeerRunError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return done.stdout, done.stderr


def tool_version(build: Build) -> str | None:
    """llama.cpp's own version and compiler lines (``--version``), when the program prints them."""
    try:
        done = subprocess.run([str(build.tool("llama-completion")), "--version"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
             if ln.lower().startswith(("version", "built with"))]
    return "; ".join(lines) or None


def measured_reference(out_dir: Path) -> dict | None:
    """The llama.cpp rows of the last ``saguaro bench peers`` (``<out_dir>/bench_peers.json``): {"cpu": summary,
    "threads": n, "rows": {label: median decode tok/s}}, or None when it has not run."""
    import json
    path = out_dir / "bench_peers.json"
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rows = {payload["labels"][key]: s["tok_s_median"] for key, s in payload["summary"].items()
            if key.startswith("llama-") and key in payload.get("labels", {})}
    return {"cpu": payload.get("cpu", {}).get("summary"), "threads": payload.get("threads"), "rows": rows,
            "file": str(path)} if rows else None
