"""Runs llama.cpp's own converter (``convert_hf_to_gguf.py``'s model classes) on one HF folder and
records every tensor it would write, without writing a GGUF. Used by :mod:`voodoo.tensormap`;
run as a script in a subprocess whose ``PYTHONPATH`` holds the pinned llama.cpp source and its
``gguf-py`` (the converter must use its own gguf-py, not the installed one)::

    python _converter_probe.py SRC_DIR SPEC.json

``SPEC.json``: ``{"runs": [[HF_DIR, OUT_PREFIX], ...], "flags": [converter flags]}``; one
process converts every run (the converter's imports cost more than a small model). Each run
writes ``OUT_PREFIX.npz`` (GGUF name -> float32 array in the converter's numpy order, exactly
what it hands to ``GGUFWriter.add_tensor`` for ``--outtype f32``) and ``OUT_PREFIX.json``
(``{"arch": gguf arch name, "hf_arch": ..., "tensors": [{"name", "shape", "dtype"}]}``).
Flags understood: ``--no-mtp``, ``--fuse-qkv``, ``--fuse-gate-up-exps`` (as the converter's).
Exit status 3 with a one-line reason when the converter does not know the architecture.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    src, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    flags = spec.get("flags", [])
    sys.path.insert(0, src)
    sys.path.insert(1, os.path.join(src, "gguf-py"))
    import numpy as np
    import torch

    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hf_dir = Path(spec["runs"][0][0])
    hparams = ModelBase.load_hparams(hf_dir, False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    try:
        cls = get_model_class(arch)
    except NotImplementedError:
        print(f"UNSUPPORTED {arch}", file=sys.stderr)
        return 3
    kw = {}
    if "--fuse-qkv" in flags:
        kw["fuse_qkv"] = True
    if "--fuse-gate-up-exps" in flags:
        kw["fuse_gate_up_exps"] = True
    if "--no-mtp" in flags:
        if not cls.supports_mtp_export:
            print(f"--no-mtp is not supported by the converter for {arch}", file=sys.stderr)
            return 2
        cls.no_mtp = True
    for hf_dir, out_prefix in spec["runs"]:
        _convert(cls, Path(hf_dir), out_prefix, kw, np, torch, gguf)
    return 0


def _convert(cls, hf_dir, out_prefix, kw, np, torch, gguf):
    with torch.inference_mode():
        m = cls(hf_dir, gguf.LlamaFileType.ALL_F32, Path(out_prefix + ".gguf"), eager=True,
                dry_run=True, **kw)
        recorded = {}
        meta = []
        archs = []

        # on the class, not the instance: a model class may hand the work to another one
        # with its own writer (Mistral3Model's ``impl``: Ministral3 or Mistral4)
        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None,
                       tensor_endianess=None):
            a = np.asarray(tensor)
            if a.dtype.kind == "f" and a.dtype != np.float32:
                a = a.astype(np.float32)
            recorded[name] = np.ascontiguousarray(a)
            meta.append({"name": name, "shape": list(a.shape),
                         "dtype": getattr(raw_dtype, "name", str(a.dtype))})
            archs.append(self.arch)

        original = gguf.GGUFWriter.add_tensor
        gguf.GGUFWriter.add_tensor = add_tensor
        try:
            m.prepare_tensors()
        finally:
            gguf.GGUFWriter.add_tensor = original
    # the arch of the writer that got the tensors (a delegating class's own is a placeholder)
    arch = archs[-1] if archs else gguf.MODEL_ARCH_NAMES[m.model_arch]
    np.savez(out_prefix + ".npz", **{f"t{i}": recorded[d["name"]] for i, d in enumerate(meta)})
    Path(out_prefix + ".json").write_text(json.dumps({
        "arch": arch, "hf_arch": m.hf_arch
        if hasattr(m, "hf_arch") else "", "tensors": meta}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
