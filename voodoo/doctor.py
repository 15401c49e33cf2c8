"""``voodoo doctor``: what this machine has for Voodoo, and a self-check of the libggml bridge.

Prints Python, torch, CUDA/ROCm and the GPUs seen, Ray (and the cluster's resources when
connected), the libggml path and llama.cpp commit, which llama.cpp tools are built, the cache
folders, the vendor environment defaults for multi-GPU runs, and quantizes a small tensor to
every type, comparing the dequantized values with ``gguf.quants.dequantize`` bit for bit.
With ``--model M``, also where that model's files are: the HF folder, the base F32 GGUF (what
candidates are quantized from, and what the ``--tensor-type-file`` recipe feeds
``llama-quantize``), the reference GGUF (what KLD is measured against) and the
``voodoo.model`` value its GGUFs record. ``--prune_cache DAYS`` deletes cache entries unused
for that long instead (:mod:`voodoo.cacheprune`).
Exit status 0 when everything needed is there, 1 otherwise (each problem says what to do).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from . import llamacpp

SELF_CHECK_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K",
                    "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "IQ4_NL", "Q5_1", "Q5_0",
                    "Q4_1", "Q4_0")


def vendor_env() -> dict[str, str]:
    """Environment defaults Voodoo applies to multi-GPU runs (``voodoo tp``): NVLink multicast
    off (NCCL/PyTorch/NVSHMEM), the expandable-segments allocator; RCCL settings on ROCm."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    try:
        import torch
        if getattr(torch.version, "hip", None):
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
            env.update({"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True",
                        "RCCL_MSCCL_ENABLE": "0", "HSA_FORCE_FINE_GRAIN_PCIE": "1"})
    except ImportError:
        pass
    return env


def self_check() -> list[str]:
    """Quantizes a (4, 512) tensor to every type in :data:`SELF_CHECK_TYPES` and compares the
    dequantized values with gguf-py's. Returns a list of problems (empty when all agree)."""
    import cython_ggml as cg
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gdq

    cg.check_abi()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    im = (rng.random(512) + 0.1).astype(np.float32)
    bad = []
    for name in SELF_CHECK_TYPES:
        q = cg.quantize(x, name, imatrix=im)
        ours = cg.dequantize(q, name, 512)
        ref = gdq(q, T[name]).reshape(ours.shape).astype(np.float32)
        if not np.array_equal(ours.view(np.uint32), ref.view(np.uint32)):
            bad.append(f"{name}: dequantized values differ from gguf.quants.dequantize")
    return bad


def model_paths(model_arg: str, out=sys.stdout) -> None:
    """Prints where a model's files are (prepares it first: converting an HF folder or a GGUF
    takes a while the first time)."""
    from .export import record_model
    from .models import prepare_model
    p = prepare_model(model_arg)
    print(f"\nmodel {p.name} ({p.source} input)", file=out)
    for k, v in (("HF folder", p.hf_dir), ("base F32 GGUF", p.base_gguf),
                 ("reference GGUF", p.reference_gguf), ("voodoo.model", record_model(p))):
        print(f"  {k:<22} {v}", file=out)
    from .llamacpp import tool_command
    quantize = tool_command("llama-quantize")
    print(f"  recipe                 {quantize} --imatrix <run>/imatrix.gguf "
          f"--tensor-type-file <run>/<stem>.tensor-types.txt {p.base_gguf} out.gguf Q8_0",
          file=out)


def run(out=sys.stdout, model: str | None = None) -> int:
    """Prints the report (to ``out``); ``model``: also :func:`model_paths`. Returns the exit
    status (0: all good, 1: problems listed)."""
    problems: list[str] = []
    from .fsutil import file_in_the_way
    vc = os.environ.get("VOODOO_CACHE")
    if vc and file_in_the_way(vc) is not None:
        problems.append(f"VOODOO_CACHE={vc} is (under) a file, not a folder: point it at a "
                        "folder (created if missing), or unset it for ~/.cache/voodoo")

    def line(k, v):
        print(f"  {k:<22} {v}", file=out)

    print("voodoo doctor", file=out)
    from pathlib import Path as _P
    line("voodoo", f"{_P(__file__).resolve().parent} (the source this command runs)")
    line("python", f"{platform.python_version()} ({sys.executable})")
    line("platform", f"{platform.platform()}, {os.cpu_count()} cores")
    gpu = False
    try:
        import torch
        line("torch", torch.__version__)
        gpu = torch.cuda.is_available()
        if gpu:
            kind = "ROCm " + torch.version.hip if getattr(torch.version, "hip", None) \
                else "CUDA " + str(torch.version.cuda)
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            line("accelerator", f"{kind}: {len(gpus)} GPU(s): {', '.join(gpus)}")
            try:
                import triton
                from .lazy import lazy_kernel_choice
                line("--lazy kernels", f"{lazy_kernel_choice()} (Triton {triton.__version__}; "
                     f"VOODOO_LAZY_KERNEL=inductor for the torch.compile'd ones)")
            except ImportError:
                line("--lazy kernels", "torch.compile'd (Triton not importable: --lazy runs "
                     "slower; pip install triton)")
            except ValueError as e:
                problems.append(str(e))
        else:
            line("accelerator", "none (CPU only: gate training runs on the CPU in float32)")
    except ImportError:
        problems.append("torch is not installed: pip install -e .")
    for mod in ("transformers", "gguf", "pyarrow"):
        try:
            m = __import__(mod)
            line(mod, getattr(m, "__version__", "installed"))
        except ImportError:
            problems.append(f"{mod} is not installed: pip install -e .")
    try:
        import ray
        line("ray", ray.__version__)
        if ray.is_initialized():
            line("ray cluster", ray.cluster_resources())
        elif os.environ.get("RAY_ADDRESS"):
            line("ray cluster", f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} (not connected)")
        else:
            line("ray cluster", "not connected (a local ray.init() is used by default)")
    except ImportError:
        problems.append("ray is not installed: pip install -e . (ray[train,tune]>=2.51)")

    line("llama.cpp commit", llamacpp.llama_cpp_commit() + (
        "" if not os.environ.get("VOODOO_LLAMA_CPP_COMMIT") else " (VOODOO_LLAMA_CPP_COMMIT)"))
    line("cache", f"{llamacpp.cache_root()} ({cache_usage(llamacpp.cache_root())})")
    try:
        import cython_ggml
        line("libggml-base", cython_ggml.library_path())
    except ImportError as e:
        problems.append(f"cython_ggml cannot load libggml-base: {e}")
        cython_ggml = None
    try:   # the converter every model goes through (tensor map, F32 base GGUF)
        line("llama.cpp source", f"{llamacpp.source_dir()} (convert_hf_to_gguf.py)")
    except llamacpp.LlamaCppNotBuilt as e:
        line("llama.cpp source", "MISSING")
        problems.append(f"{e} (it fetches the pinned source, sha256-checked; builds "
                        "already there are kept)")
    tools = llamacpp.tools_status()
    for t, p in tools.items():
        role = "chat/serve" if t in llamacpp.CHAT_TOOLS else "pipeline"
        line(t, f"{p} ({role})" if p else f"MISSING ({role})")
    missing = [t for t, p in tools.items() if not p]
    own = os.environ.get("VOODOO_LLAMA_CPP")
    if missing and own:
        problems.append(f"llama.cpp tools missing ({', '.join(missing)}) from VOODOO_LLAMA_CPP="
                        f"{own}{'' if Path(own).is_dir() else ', which does not exist'}: point "
                        "it at a llama.cpp build folder that has them, or unset it to use "
                        "Voodoo's own build (`voodoo bootstrap`)")
    elif missing:
        problems.append(f"llama.cpp tools missing ({', '.join(missing)}): run `voodoo "
                        "bootstrap` (builds only what is missing; a few minutes on 2 cores) "
                        "or set VOODOO_LLAMA_CPP=/path/to/llama.cpp/build")
    env = vendor_env()
    if gpu or any(k in os.environ for k in env):
        for k, v in env.items():
            line(f"env {k}", f"{os.environ.get(k, '(unset)')} (voodoo tp sets {v})")
    else:  # GPU/NCCL settings: noise on a CPU machine where none is set
        line("GPU/NCCL env", f"none set of {', '.join(env)}; voodoo tp sets them on GPU "
                             "workers")
    if cython_ggml is not None:
        line("self-check", f"running: {len(SELF_CHECK_TYPES)} types through libggml (its IQ "
                           "types build their grids on first use: up to a minute)")
        t0 = time.monotonic()
        try:
            bad = self_check()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            bad = [f"self-check crashed: {e}"]
        if bad:
            problems += bad
            line("self-check", "FAILED")
        else:
            line("self-check", f"OK: {len(SELF_CHECK_TYPES)} types quantized by libggml, "
                               "dequantized bit-exactly as gguf.quants "
                               f"({time.monotonic() - t0:.0f} s)")
    if model:
        try:
            model_paths(model, out)
        except (ValueError, OSError, RuntimeError) as e:
            problems.append(f"--model {model}: {e}")
    if problems:
        print("\nproblems:", file=out)
        for p in problems:
            print(f"  - {p}", file=out)
        return 1
    print("\nall good", file=out)
    return 0


def cache_usage(root: Path) -> str:
    """``"3.2 GiB: models 2.1, candidates 0.8, ..."``: the size of Voodoo's cache and of its
    largest sub-folders (GiB), so a full disk is easy to trace. What is deleted there is rebuilt
    on demand (``llama.cpp`` by ``voodoo bootstrap``), except ``models/by-sha256``: the map from
    an exported GGUF's ``voodoo.model`` hash to its reference model."""
    root = Path(root)
    if not root.is_dir():
        return "empty"
    sizes = {}
    for sub in root.iterdir():
        n = 0
        for dirpath, _dirs, files in os.walk(sub) if sub.is_dir() else [(root, [], [sub.name])]:
            for f in files:
                try:
                    n += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
        sizes[sub.name] = n
    total = sum(sizes.values()) / 2**30
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:4]
    return f"{total:.1f} GiB: " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in top if v)
