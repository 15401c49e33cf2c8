"""voodoo.llamacpp's build logic: a cache holding the pipeline's tools gets the chat tools
without rebuilding the others; a failed build leaves the cached tools as they were. CMake is
replaced by a stand-in that records what it was asked to build (the real build is exercised
by `voodoo bootstrap` in scripts/install.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from voodoo import llamacpp


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VOODOO_LLAMA_CPP", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setattr(llamacpp, "fetch_source", lambda: src)
    calls = []

    def fake_cmake(args, desc, log):
        calls.append(list(args))
        if "--build" in args:
            work = Path(args[args.index("--build") + 1])
            targets = args[args.index("--target") + 1: args.index("-j")]
            if "broken" in targets:
                raise RuntimeError("build broken failed (exit 2)")
            (work / "bin").mkdir(parents=True, exist_ok=True)
            for t in targets:
                (work / "bin" / t).write_text(f"built {t} #{len(calls)}")
                (work / "bin" / t).chmod(0o755)
        return 0.0

    monkeypatch.setattr(llamacpp, "_cmake", fake_cmake)
    return calls


def _builds(calls):
    return [c[c.index("--target") + 1: c.index("-j")] for c in calls if "--build" in c]


def test_only_missing_tools_are_built(fake_cache):
    calls = fake_cache
    bin_dir = llamacpp.build_tools(tools=llamacpp.PIPELINE_TOOLS)
    assert _builds(calls) == [list(llamacpp.PIPELINE_TOOLS)]
    first = {t: (bin_dir / t).read_text() for t in llamacpp.PIPELINE_TOOLS}
    # the server is configured on (llama-cli and llama-server need it), its web UI off
    conf = next(c for c in calls if "-S" in c)
    assert "-DLLAMA_BUILD_SERVER=ON" in conf and "-DLLAMA_USE_PREBUILT_UI=OFF" in conf

    calls.clear()
    assert llamacpp.build_tools() == bin_dir          # the default: every tool
    assert _builds(calls) == [list(llamacpp.CHAT_TOOLS)]
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted(
        [*llamacpp.TOOLS, "BUILD_INFO.json"])
    assert {t: (bin_dir / t).read_text() for t in llamacpp.PIPELINE_TOOLS} == first
    assert json.loads((bin_dir / "BUILD_INFO.json").read_text()) == llamacpp._tools_info()
    assert not list(bin_dir.parent.glob("bin.partial-*"))

    calls.clear()
    llamacpp.build_tools()                            # all cached: nothing runs
    assert calls == []
    assert all(llamacpp.tools_status().values())


def test_failed_build_keeps_the_cached_tools(fake_cache, monkeypatch):
    bin_dir = llamacpp.build_tools(tools=llamacpp.PIPELINE_TOOLS)
    before = sorted(p.name for p in bin_dir.iterdir())
    with pytest.raises(RuntimeError, match="broken"):
        llamacpp.build_tools(tools=(*llamacpp.PIPELINE_TOOLS, "broken"))
    assert sorted(p.name for p in bin_dir.iterdir()) == before
    assert not list(bin_dir.parent.glob("bin.partial-*"))


def test_other_build_options_rebuild_everything(fake_cache):
    calls = fake_cache
    bin_dir = llamacpp.build_tools()
    info = json.loads((bin_dir / "BUILD_INFO.json").read_text())
    (bin_dir / "BUILD_INFO.json").write_text(json.dumps({**info, "version": -1}))
    calls.clear()
    llamacpp.build_tools()
    assert _builds(calls) == [list(llamacpp.TOOLS)]


def test_missing_tool_error_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VOODOO_LLAMA_CPP", raising=False)
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="voodoo bootstrap.*only what is missing"):
        llamacpp.tool_path("llama-server")


def test_exit_wait_shim_lets_a_log_thread_finish(tmp_path, monkeypatch):
    """The shim preloaded by tool_env keeps a process alive at exit long enough for a worker
    thread to print its last line, the way common_log's worker prints llama-perplexity's final
    statistics. A stand-in program returns from main while its printing thread still sleeps
    50 ms: without the shim the line is lost, with it the line arrives."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp, "_EXIT_WAIT_LIB", [])
    src = tmp_path / "late.c"
    src.write_text('#include <pthread.h>\n#include <stdio.h>\n#include <unistd.h>\n'
                   'static void *late(void *a) { usleep(50000); printf("LAST LINE\\n"); '
                   'fflush(stdout); return a; }\n'
                   'int main(void) { pthread_t t; pthread_create(&t, 0, late, 0); '
                   'printf("first\\n"); fflush(stdout); return 0; }\n')
    exe = tmp_path / "late"
    subprocess.run([cc, "-O2", "-pthread", "-o", str(exe), str(src)], check=True)
    plain = subprocess.run([str(exe)], capture_output=True, text=True)
    assert plain.stdout == "first\n"
    env = llamacpp.tool_env()
    lib = llamacpp.exit_wait_lib()
    assert lib is not None and lib.is_file() and str(lib) in env["LD_PRELOAD"].split()
    assert lib.parent == tmp_path / "cache" / "shims"
    shimmed = subprocess.run([str(exe)], capture_output=True, text=True, env=env)
    assert shimmed.returncode == 0 and shimmed.stdout == "first\nLAST LINE\n", shimmed
    # an LD_PRELOAD already set is kept, and the shim is not added twice
    env2 = llamacpp.tool_env({**env, "LD_PRELOAD": env["LD_PRELOAD"] + " /x.so"})
    assert env2["LD_PRELOAD"].split().count(str(lib)) == 1 and "/x.so" in env2["LD_PRELOAD"]


def test_voodoo_llama_cpp_is_the_only_place_looked_when_set(tmp_path, monkeypatch):
    """A VOODOO_LLAMA_CPP that does not exist, or lacks a tool, is named, not silently
    replaced by the cached build (two llama.cpp builds would be mixed without a word)."""
    cache_bin = tmp_path / "cache" / "llama.cpp" / llamacpp.llama_cpp_commit() / "bin"
    cache_bin.mkdir(parents=True)
    own = tmp_path / "mine"
    own.mkdir()
    for d, tools in ((cache_bin, ("llama-quantize", "llama-perplexity")),
                     (own, ("llama-quantize",))):
        for t in tools:
            (d / t).write_text("#!/bin/sh\n")
            (d / t).chmod(0o755)
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VOODOO_LLAMA_CPP", raising=False)
    assert llamacpp.tool_path("llama-perplexity") == cache_bin / "llama-perplexity"
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(own))
    assert llamacpp.tool_path("llama-quantize") == own / "llama-quantize"
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="holds no executable llama-perplexity"):
        llamacpp.tool_path("llama-perplexity")
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(tmp_path / "nowhere"))
    with pytest.raises(llamacpp.LlamaCppNotBuilt, match="does not exist"):
        llamacpp.tool_path("llama-quantize")
