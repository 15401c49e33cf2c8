"""llama.cpp from a pinned source: fetch, build, locate.

llama.cpp's source comes from the ``llama-cpp-python`` source distribution on PyPI (its
``vendor/llama.cpp`` holds llama.cpp at a fixed commit), pinned by version and sha256 below.
Builds live outside the repository, in ``$VOODOO_CACHE/llama.cpp/<commit>/`` (default
``~/.cache/voodoo``)::

    src/   the vendored llama.cpp tree
    lib/   libggml-base.so (shared; what cython_ggml loads; about 20 s)
    bin/   static builds of the pipeline's tools (llama-quantize, llama-perplexity,
           llama-imatrix, llama-tokenize) and of the tools that talk to a GGUF
           (llama-completion, llama-cli, llama-server); on 2 idle cores about 3 min for the
           first four and 2 more for the others (3 CPU-minutes measured)

``lib/`` and ``bin/`` are staged in ``*.partial-*`` folders and renamed into place only when
complete, so an interrupted build never leaves a folder that looks finished. The CMake build
folder (``build-tools/``) is kept, so a later build of more tools compiles only what they add
(a cache that has the first four gets the others without recompiling them). One build at a
time per cache (a lock file).

``VOODOO_GGML_LIB=/path/libggml-base.so`` and ``VOODOO_LLAMA_CPP=/path/to/build`` (a folder
holding the tools, directly or in ``bin/``) point Voodoo at a llama.cpp of your own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .progress import room_log

#: llama-cpp-python release whose sdist carries the llama.cpp source Voodoo builds.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: sha256 of ``llama_cpp_python-0.3.36.tar.gz`` on PyPI.
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: llama.cpp commit vendored in that sdist (its CHANGELOG: "update llama.cpp to
#: ggml-org/llama.cpp@0c1e57098").
LLAMA_CPP_COMMIT = "0c1e57098"

#: The tools the pipeline runs (quantize stock types, measure PPL/KLD, imatrix, and the
#: pre-flight check's tokenizer comparison).
PIPELINE_TOOLS = ("llama-quantize", "llama-perplexity", "llama-imatrix", "llama-tokenize")
#: The tools that generate text with a GGUF: ``voodoo chat`` (llama-completion, one turn with
#: the model's chat template), ``voodoo serve`` (llama-server), and llama-cli (interactive).
CHAT_TOOLS = ("llama-completion", "llama-cli", "llama-server")
#: Everything ``voodoo bootstrap`` builds into ``bin/``.
TOOLS = PIPELINE_TOOLS + CHAT_TOOLS


class LlamaCppNotBuilt(RuntimeError):
    """A llama.cpp artefact (library, tool or source) is missing."""


#: Marks a folder as Voodoo's cache (the Cache Directory Tagging convention, which backup
#: tools honour); ``voodoo doctor --prune_cache`` prunes only a folder that has it or a
#: ``llama.cpp/`` build folder.
CACHE_TAG = "CACHEDIR.TAG"
_CACHE_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                   "# Voodoo's cache: everything here is rebuilt on demand "
                   "(voodoo doctor --prune_cache DAYS).\n")


def cache_root() -> Path:
    """Voodoo's cache folder: ``$VOODOO_CACHE`` (an empty value counts as unset), else
    ``~/.cache/voodoo``; absolute."""
    return Path(os.path.expanduser(os.environ.get("VOODOO_CACHE") or "~/.cache/voodoo")
                ).absolute()


def mark_cache(root: Path | None = None) -> None:
    """Writes :data:`CACHE_TAG` into the cache folder (``root``, default :func:`cache_root`)
    when it exists and has none; a read-only folder is left as it is."""
    root = cache_root() if root is None else Path(root)
    tag = root / CACHE_TAG
    if root.is_dir() and not tag.exists():
        try:
            tag.write_text(_CACHE_TAG_TEXT)
        except OSError:
            pass


def build_root(commit: str = LLAMA_CPP_COMMIT) -> Path:
    """``<cache>/llama.cpp/<commit>``: everything built from that llama.cpp commit."""
    return cache_root() / "llama.cpp" / commit


def llama_cpp_commit() -> str:
    """The llama.cpp commit in use: ``$VOODOO_LLAMA_CPP_COMMIT`` (for a user build) or the pin."""
    return os.environ.get("VOODOO_LLAMA_CPP_COMMIT", LLAMA_CPP_COMMIT)


def source_dir() -> Path:
    """The llama.cpp source tree (``convert_hf_to_gguf.py`` lives there). Raises
    LlamaCppNotBuilt when it has not been fetched."""
    d = build_root() / "src"
    if not (d / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppNotBuilt(f"llama.cpp source not found at {d}; run `voodoo bootstrap`")
    return d


def quantize_ftypes() -> list[str] | None:
    """The file types ``llama-quantize`` accepts by name (``QUANT_OPTIONS`` in the pinned
    ``tools/quantize/quantize.cpp``, parsed), upper case; None when the source is not here."""
    import re
    try:
        text = (source_dir() / "tools" / "quantize" / "quantize.cpp").read_text()
    except (LlamaCppNotBuilt, OSError):
        return None
    i = text.find("QUANT_OPTIONS")
    names = re.findall(r'\{\s*"([A-Za-z0-9_]+)"\s*,\s*LLAMA_FTYPE_', text[i:]) if i >= 0 else []
    return [n.upper() for n in names] or None


def lib_path() -> Path:
    """libggml-base.so: ``$VOODOO_GGML_LIB`` or the cached build. Raises LlamaCppNotBuilt."""
    env = os.environ.get("VOODOO_GGML_LIB")
    if env:
        if not Path(env).is_file():
            raise LlamaCppNotBuilt(f"VOODOO_GGML_LIB={env} does not exist")
        return Path(env)
    p = build_root() / "lib" / "libggml-base.so"
    if not p.is_file():
        raise LlamaCppNotBuilt(f"{p} not built; run `voodoo bootstrap --lib_only` (about 20 s)")
    return p


def tool_command(name: str) -> str:
    """What to type to run a llama.cpp tool in a printed command: its full path when built
    (the cached build is not on PATH), else its bare name."""
    try:
        return str(tool_path(name))
    except LlamaCppNotBuilt:
        return name


def tool_path(name: str) -> Path:
    """Path of a llama.cpp tool (one of :data:`TOOLS`, e.g. ``llama-perplexity``).

    Looks in ``$VOODOO_LLAMA_CPP`` (or its ``bin/``) when it is set, and only there (a build
    of one's own is never mixed with Voodoo's), else in the cached build. Raises
    LlamaCppNotBuilt saying how to build it, or that ``$VOODOO_LLAMA_CPP`` lacks it."""
    env = os.environ.get("VOODOO_LLAMA_CPP")
    if env:
        cands = [Path(env) / name, Path(env) / "bin" / name]
        for c in cands:
            if c.is_file() and os.access(c, os.X_OK):
                return c
        where = "does not exist" if not Path(env).is_dir() else f"holds no executable {name}"
        raise LlamaCppNotBuilt(
            f"{name} not found: VOODOO_LLAMA_CPP={env} {where} (looked in {cands[0].parent} and "
            f"{cands[1].parent}); point it at a llama.cpp build folder that has {name}, or "
            "unset it to use Voodoo's own build (`voodoo bootstrap`)")
    cands = [build_root() / "bin" / name]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise LlamaCppNotBuilt(
        f"{name} not found (looked in {', '.join(str(c.parent) for c in cands)}); run "
        "`voodoo bootstrap` (it builds only what is missing: a few minutes on 2 cores, "
        "once) or set VOODOO_LLAMA_CPP to a llama.cpp build folder")


#: C source of the exit shim preloaded into llama.cpp's tools (see :func:`tool_env`).
_EXIT_WAIT_C = """\
/* Voodoo: preloaded into llama.cpp's tools. common/log.cpp prints from a worker thread and
   leaks its logger on purpose (llama.cpp issue #22142), so a process that exits while the
   worker waits for a CPU loses its last lines: on a loaded machine llama-perplexity exits 0
   without its final statistics. Waiting at exit lets the worker drain its queue. */
#include <unistd.h>
__attribute__((destructor)) static void voodoo_exit_wait(void) { usleep(%d); }
"""
#: How long the shim waits at exit (microseconds).
EXIT_WAIT_US = 300_000
_EXIT_WAIT_LIB: list = []


def exit_wait_lib() -> Path | None:
    """The shared library :func:`tool_env` preloads, built on first use (``cc``, ~0.1 s) into
    ``<cache>/shims/``; None where no C compiler is found or the build fails (the tools then
    run as they are, and callers fall back to running them again).

    Why: llama.cpp's ``common_log`` writes from a worker thread and its logger is leaked at
    exit (``common_log_main()`` in common/log.cpp, llama.cpp issue #22142). Measured on the
    2-core machine with 4 busy loops: llama-perplexity ``--kl-divergence`` printed no final
    statistics in 33 of 40 runs; with the shim (a destructor that sleeps 0.3 s at exit), 0 of
    40. The tools' own code and results are unchanged."""
    if _EXIT_WAIT_LIB:
        return _EXIT_WAIT_LIB[0]
    lib = cache_root() / "shims" / f"libvoodoo-exit-wait-{EXIT_WAIT_US}.so"
    if not lib.is_file():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            return None
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src, out = Path(tmp) / "exit_wait.c", Path(tmp) / lib.name
                src.write_text(_EXIT_WAIT_C % EXIT_WAIT_US)
                r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
                if r.returncode or not out.is_file():
                    return None
                os.replace(out, lib)
        except (OSError, subprocess.SubprocessError):
            return None
    _EXIT_WAIT_LIB.append(lib)
    return lib


def tool_env(env: dict | None = None) -> dict:
    """The environment to run a llama.cpp tool with: ``env`` (default ``os.environ``) with
    :func:`exit_wait_lib` added to ``LD_PRELOAD`` (on Linux, when it could be built), so the
    tool's last log lines reach its stdout even on a loaded machine."""
    env = dict(os.environ if env is None else env)
    lib = exit_wait_lib() if sys.platform.startswith("linux") else None
    if lib is not None:
        pre = env.get("LD_PRELOAD", "")
        if str(lib) not in pre.split():
            env["LD_PRELOAD"] = f"{lib} {pre}".strip()
    return env


def tools_status() -> dict[str, str | None]:
    """{tool name: path or None} for every tool in :data:`TOOLS`."""
    out = {}
    for t in TOOLS:
        try:
            out[t] = str(tool_path(t))
        except LlamaCppNotBuilt:
            out[t] = None
    return out


# ------------------------------------------------------------------------------- building
_log = room_log("bootstrap")


def _sha256(path: Path) -> str:
    from .fsutil import sha256_file
    return sha256_file(path)


def fetch_source() -> Path:
    """Downloads the pinned llama-cpp-python sdist with pip, checks its sha256 and unpacks
    ``vendor/llama.cpp`` to ``<build_root>/src`` (atomically). Returns that folder.

    Raises RuntimeError when pip fails or the checksum differs."""
    dst = build_root() / "src"
    if (dst / "convert_hf_to_gguf.py").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    mark_cache()
    dl = cache_root() / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.is_file() or _sha256(sdist) != LLAMA_CPP_PYTHON_SHA256:
        _log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist with pip")
        with tempfile.TemporaryDirectory(dir=dl) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--progress-bar", "on", "-d", tmp,
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
            r = subprocess.run(cmd)
            if r.returncode:
                raise RuntimeError(f"pip download failed ({' '.join(cmd)}); check that PyPI "
                                   "is reachable")
            got = next(Path(tmp).glob("*.tar.gz"))
            digest = _sha256(got)
            if digest != LLAMA_CPP_PYTHON_SHA256:
                raise RuntimeError(f"sha256 of {got.name} is {digest}, expected "
                                   f"{LLAMA_CPP_PYTHON_SHA256}; refusing to build from it")
            os.replace(got, sdist)
    _log(f"unpacking vendor/llama.cpp ({LLAMA_CPP_COMMIT}) to {dst}")
    tmp = Path(tempfile.mkdtemp(prefix="src.partial-", dir=dst.parent))
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        tf.extractall(tmp, members=members, filter="data")
    os.replace(tmp, dst)
    return dst


_PCT = re.compile(r"^\[\s*(\d+)%\]")
_STEP = re.compile(r"(?:Building \w+ object \S*?([^/\s]+)\.o|Linking \w+ \w+ \S*?([^/\s]+))$")


def _cmake(args: list[str], desc: str, log: Path) -> float:
    """Runs cmake, streaming its ``[ NN%]`` lines into a progress bar (a tqdm bar on a
    terminal, a plain line every 10% or 30 s otherwise: :class:`voodoo.progress.Progress`);
    full log in ``log``. Returns the wall time in seconds. Raises RuntimeError with the log's
    tail when cmake fails."""
    from .progress import Progress
    bar = Progress(100, desc, unit="%", prefix="[voodoo bootstrap] ")
    with open(log, "a", buffering=1) as lf:  # line-buffered: `tail -f` works
        lf.write("$ " + " ".join(args) + "\n")
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            lf.write(line)
            m = _PCT.match(line)
            step = _STEP.search(line.rstrip())
            note = None if step is None else \
                (f"compiling {step.group(1)}" if step.group(1) else f"linking {step.group(2)}")
            if m or note:
                bar.set(int(m.group(1)) if m else bar.n, note)
        rc = p.wait()
    dt = bar.close(ok=rc == 0)
    if rc:
        tail = "".join(open(log).readlines()[-25:])
        raise RuntimeError(f"{desc} failed (exit {rc}); full log: {log}\n{tail}")
    return dt


#: Bumped whenever the tool build options change, so cached tools are rebuilt.
TOOLS_BUILD_VERSION = 2


def cpu_flags() -> list[str]:
    """ggml CPU options for this machine's x86 features, without AMX.

    ``GGML_NATIVE`` (``-march=native``) turns on AMX wherever the CPU reports it, but virtual
    machines often report AMX without enabling it for processes, and llama-perplexity then dies
    with SIGILL in ``tinygemm_kernel_amx``. So on x86 Voodoo names the features itself
    (SSE4.2, F16C, FMA, BMI2, AVX, AVX2, AVX-VNNI, AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16) and
    leaves AMX off. Quantized bytes do not depend on this: quantization lives in libggml-base,
    which is compiled without CPU-specific flags. Elsewhere ``GGML_NATIVE`` is kept."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        feats = set()
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                feats = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return []
    want = {"GGML_SSE42": {"sse4_2"}, "GGML_F16C": {"f16c"}, "GGML_FMA": {"fma"},
            "GGML_BMI2": {"bmi2"}, "GGML_AVX": {"avx"}, "GGML_AVX2": {"avx2"},
            "GGML_AVX_VNNI": {"avx_vnni"},
            "GGML_AVX512": {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
            "GGML_AVX512_VBMI": {"avx512vbmi"}, "GGML_AVX512_VNNI": {"avx512_vnni"},
            "GGML_AVX512_BF16": {"avx512_bf16"}}
    out = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
           "-DGGML_AMX_BF16=OFF"]
    out += [f"-D{k}={'ON' if need <= feats else 'OFF'}" for k, need in want.items()]
    return out


def _configure_args(src: Path, build: Path, shared: bool) -> list[str]:
    """CMake options. The server (and llama-cli, which is built on it) is configured on for
    the tools build; its web UI is neither built (npm) nor downloaded (``LLAMA_UI_*`` off):
    ``voodoo serve`` answers HTTP API requests only. These options add targets; they do not
    change how the pipeline's tools are compiled."""
    return ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            f"-DLLAMA_BUILD_SERVER={'OFF' if shared else 'ON'}", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_CCACHE=OFF",
            *([] if shared else cpu_flags())]


def _tools_info() -> dict:
    return {"version": TOOLS_BUILD_VERSION, "cmake_cpu_flags": cpu_flags(),
            "commit": LLAMA_CPP_COMMIT}


def _jobs() -> str:
    return str(os.environ.get("VOODOO_BUILD_JOBS") or os.cpu_count() or 2)


class _BuildLock:
    """An exclusive lock on ``<build_root>/build.lock`` (``fcntl.flock``) while building, so
    two processes sharing a cache never build into the same folder; the second waits and then
    finds the first's result."""

    def __init__(self, root: Path):
        self.path = root / "build.lock"

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a")
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _log(f"another process is building llama.cpp in {self.path.parent}; waiting")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.f.close()  # releases the lock


def _stage_dir(root: Path, prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    os.chmod(d, 0o755)  # mkdtemp makes 0700; the cache is meant to be readable
    return d


def build_lib(force: bool = False) -> Path:
    """Builds libggml-base.so (shared) into ``<build_root>/lib`` (about 20 s) and returns its
    path; reuses a cached build unless ``force``."""
    root = build_root()
    final = root / "lib"
    if (final / "libggml-base.so").is_file() and not force:
        return final / "libggml-base.so"
    src = fetch_source()
    with _BuildLock(root):
        if (final / "libggml-base.so").is_file() and not force:
            return final / "libggml-base.so"
        work = Path(tempfile.mkdtemp(prefix="build-lib.partial-", dir=root))
        log = root / "build-lib.log"
        log.write_text("")
        _cmake(_configure_args(src, work, shared=True), "configure libggml-base", log)
        _cmake(["cmake", "--build", str(work), "--target", "ggml-base", "-j", _jobs()],
               "build libggml-base", log)
        staged = _stage_dir(root, "lib.partial-")
        for so in (work / "bin").glob("libggml-base.so*"):
            shutil.copy2(so, staged / so.name, follow_symlinks=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
        shutil.rmtree(work, ignore_errors=True)
    _log(f"libggml-base: {final / 'libggml-base.so'}")
    return final / "libggml-base.so"


def _cached_tools(final: Path) -> set[str]:
    """The tools in ``final`` built with today's options (empty when BUILD_INFO differs)."""
    try:
        if json.loads((final / "BUILD_INFO.json").read_text()) != _tools_info():
            return set()
    except (OSError, ValueError):
        return set()
    return {t for t in TOOLS if (final / t).is_file()}


def build_tools(force: bool = False, tools: tuple[str, ...] = TOOLS) -> Path:
    """Builds the llama.cpp ``tools`` (static; default :data:`TOOLS`) into
    ``<build_root>/bin`` and returns that folder.

    Only tools that are missing are built (all of them when ``force`` or when the cached ones
    were built with other options, see ``BUILD_INFO.json``); the CMake folder
    ``<build_root>/build-tools`` is kept, so adding tools to a cache compiles only what they
    add. On 2 idle cores: about 3 min for the pipeline's tools, about 2 min more for the
    chat tools. The new ``bin/`` (cached tools + new ones) is staged and renamed into place."""
    root = build_root()
    final = root / "bin"
    have = set() if force else _cached_tools(final)
    if all(t in have for t in tools):
        return final
    if not force and not have and (final / "BUILD_INFO.json").is_file():
        _log(f"cached tools in {final} were built with other options; rebuilding")
    src = fetch_source()
    with _BuildLock(root):
        have = set() if force else _cached_tools(final)
        todo = [t for t in tools if t not in have]
        if not todo:
            return final
        work = root / "build-tools"  # kept between builds: later targets reuse the objects
        cache_file = work / "CMakeCache.txt"
        if cache_file.is_file() and f"CMAKE_CACHEFILE_DIR:INTERNAL={work}\n" not in \
                cache_file.read_text(errors="replace"):
            shutil.rmtree(work)  # a build folder that was moved: CMake refuses to reuse it
        log = root / "build-tools.log"
        log.write_text("")
        _log(f"building {', '.join(todo)} ({_jobs()} jobs; log {log})")
        t0 = time.monotonic()
        _cmake(_configure_args(src, work, shared=False), "configure llama.cpp tools", log)
        _cmake(["cmake", "--build", str(work), "--target", *todo, "-j", _jobs()],
               "build " + ", ".join(todo), log)
        staged = _stage_dir(root, "bin.partial-")
        for t in have:
            shutil.copy2(final / t, staged / t)
        for t in todo:
            shutil.copy2(work / "bin" / t, staged / t)
        (staged / "BUILD_INFO.json").write_text(json.dumps(_tools_info(), indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
    from .progress import fmt_duration
    _log(f"built {', '.join(todo)} in {fmt_duration(time.monotonic() - t0)}: {final}")
    return final


def bootstrap(lib_only: bool = False, force: bool = False) -> dict:
    """Fetches the pinned llama.cpp and builds libggml-base (and the tools unless
    ``lib_only``). Reuses what is cached; builds only what is missing. Returns
    ``{"lib": path, "bin": path or None}``. The source is fetched even when
    ``$VOODOO_GGML_LIB`` and ``$VOODOO_LLAMA_CPP`` name builds made elsewhere: the converter
    (tensor maps, the F32 base GGUF) and llama-quantize's rules are read from it."""
    fetch_source()
    lib = build_lib(force=force) if not os.environ.get("VOODOO_GGML_LIB") else lib_path()
    out = {"lib": str(lib), "bin": None}
    if not lib_only:
        out["bin"] = str(build_tools(force=force)) if not os.environ.get("VOODOO_LLAMA_CPP") \
            else str(Path(os.environ["VOODOO_LLAMA_CPP"]))
    return out


def main(argv: list[str] | None = None) -> int:
    from .cli import ArgumentParser  # one-line errors that point at -h, as every command's
    ap = ArgumentParser(
        prog="voodoo bootstrap", description=__doc__.split("\n")[0],
        epilog=f"Builds into {build_root()} (VOODOO_CACHE moves it). On 2 idle cores: "
               "libggml-base about 20 s; llama-quantize, llama-perplexity, llama-imatrix and "
               "llama-tokenize about 3 min; llama-completion, llama-cli and llama-server "
               "about 2 min more (several times longer when the cores are busy). Cached "
               "builds are reused; only missing tools are built.")
    ap.add_argument("--lib_only", "--lib-only", action="store_true",
                    help="build libggml-base only (about 20 s): enough to quantize candidates, "
                         "train and export; not for stock types (llama-quantize), "
                         "llama-perplexity tables, chat or serve, and train skips its pre-flight "
                         "check (llama-perplexity, llama-tokenize)")
    ap.add_argument("--force", action="store_true", help="rebuild even what is cached")
    a = ap.parse_args(argv)
    out = bootstrap(lib_only=a.lib_only, force=a.force)
    print(f"libggml-base     {out['lib']}")
    if out["bin"]:
        st = tools_status()
        print(f"llama.cpp tools  {out['bin']} ({', '.join(t for t in TOOLS if st.get(t))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
