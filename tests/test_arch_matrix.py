"""Any architecture, end to end (issue 10's matrix), on the zoo of tiny random models
(tests/zoo.py). For each family:

(a) every tensor llama-quantize would quantize (its rule parsed from the pinned
    ``src/llama-quant.cpp``) in the converter's F32 GGUF is selectable, and the derived tensor
    map reproduces the F32 GGUF from the model's parameters;
(b) the exported GGUF is byte-identical to ``llama-quantize --tensor-type-file <written file>
    --imatrix <same imatrix>`` on the F32 GGUF;
(c) llama.cpp runs the exported GGUF and agrees with the torch student of the same assignment
    on the same tokens (mean KLD <= 0.01, same top-1 >= 95%), and a deliberately wrong map
    (rows not permuted, a scale dropped, a transpose flipped) fails that same check;
(d) every gate gets a non-zero gradient in one step of the real loss.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zoo import FAMILIES, ZOO_DISAGREE, make_tiny, zoo_tokens  # noqa: E402

pytestmark = pytest.mark.slow

MAX_KLD = 0.01        # nats/token, llama.cpp on the export vs the torch student
MIN_SAME_TOP = 0.95   # same top-1
WRONG_KLD = 0.05      # a wrong map must be at least this far off
#: the mixed (8-bit-activation) export: measured 0.001-0.02 KLD, 0.92-0.98 same top-1 on the
#: zoo; these bounds are ~3x the worst seen, still far below a wrong map (KLD 5-12)
MIXED_KLD = 0.06
MIXED_SAME_TOP = 0.85
MENU = "Q8_0,Q5_K,Q4_K,Q2_K"

FAMILY_LIST = [f for f in FAMILIES if f not in ZOO_DISAGREE]


@pytest.fixture(scope="module")
def tools_ready():
    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir, tool_path
    try:
        source_dir()
        tool_path("llama-quantize")
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    # ask the converter about every family in one subprocess (one per family otherwise)
    import json

    from voodoo.models import converter_info
    first, *rest = [json.loads((make_tiny(f) / "config.json").read_text()) for f in FAMILY_LIST]
    converter_info(first, also=rest)


def _assignment(ctx, menus, table):
    """A deterministic mixed assignment (tensor i gets menu entry i mod K), baked through
    voodoo.bake with a budget equal to its size."""
    from voodoo.bake import bake
    logits, total = {}, 0
    for i, s in enumerate(ctx.specs):
        k = i % len(menus[s.gguf_name])
        z = torch.full((len(menus[s.gguf_name]),), -50.0)
        z[k] = 50.0
        logits[s.gguf_name] = z
        total += table[s.gguf_name][k]
    return bake(logits, menus, table, total, tolerance=0.0)


def _student_logits(ctx, student_tmap, menus, keys, cache, assignment, tokens):
    """Logits of a fresh student (its own copy of the model) on ``student_tmap`` with the
    assignment one-hot."""
    from voodoo.agreement import torch_logits
    from voodoo.gates import install_param_gates
    from voodoo.pipeline import assign_student, bytes_table, candidate_tensors
    model = copy.deepcopy(ctx.extra["pristine"])
    cands = candidate_tensors(ctx, menus, keys, cache)
    mixed = install_param_gates(model, student_tmap, cands, bytes_table(ctx.specs, menus),
                                menus=menus)
    assign_student(mixed, assignment)
    return model, mixed, torch_logits(model, tokens)


def _wrong_map(tmap):
    """A copy of ``tmap`` with one deliberate mistake of the kind the converter's transforms
    make easy to get wrong: a dropped scale, rows left unpermuted, a transpose flipped, or else
    rows reversed. Returns (map, what was done)."""
    bad = copy.deepcopy(tmap)
    links = [(e, lk) for e in bad for lk in e.links]
    for e, lk in links:
        if lk.scale is not None:
            lk.scale = None
            return bad, f"scale of {e.gguf_name} dropped"
    for e, lk in links:
        if not np.array_equal(lk.p_rows, np.sort(lk.p_rows)):
            lk.p_rows = np.sort(lk.p_rows)
            return bad, f"rows of {e.gguf_name} left unpermuted"
    for e, lk in links:
        if lk.transpose and e.shape[0] == e.shape[1]:
            lk.transpose = False
            return bad, f"transpose of {e.gguf_name} flipped"
    e, lk = max(links, key=lambda x: x[0].n_rows * x[0].n_per_row
                if not x[0].gguf_name.startswith("token_embd") else 0)
    lk.p_rows = lk.p_rows[::-1].copy()
    return bad, f"rows of {e.gguf_name} reversed"


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_family(family, tools_ready, tmp_path):
    from voodoo.ggufio import read_gguf

    from voodoo.agreement import llama_vs_torch
    from voodoo.candidates import CandidateCache
    from voodoo.export import assignment_types
    from voodoo.llamacpp import tool_path
    from voodoo.pipeline import (bytes_table, ensure_candidates, ensure_imatrix, export,
                                 load_context, make_menus)
    from voodoo.tensormap import quantize_rule
    from voodoo.train import _logits, distill_losses

    ctx = load_context(make_tiny(family))
    ctx.extra["pristine"] = copy.deepcopy(ctx.model)
    base = read_gguf(str(ctx.prepared.base_gguf))
    arch = base.fields["general.architecture"].contents()

    # (a) every tensor llama-quantize would quantize is selectable
    rule = quantize_rule()
    want = sorted(t.name for t in base.tensors
                  if rule.allows(t.name, [int(x) for x in reversed(t.shape)], arch))
    assert sorted(ctx.tmap.names) == want, (family, set(want) ^ set(ctx.tmap.names))

    vocab = ctx.model.config.get_text_config().vocab_size
    from voodoo.agreement import _with_bos, gguf_vocab
    # each chunk starts with BOS where llama.cpp adds one (it replaces the first token)
    tokens = _with_bos(zoo_tokens(vocab, n_chunk=4, n_ctx=128, seed=1),
                       gguf_vocab(ctx.prepared.base_gguf))
    im = ensure_imatrix(ctx, tmp_path / "imatrix.gguf", tokens)
    menus = make_menus(ctx.specs, MENU)
    table = bytes_table(ctx.specs, menus)
    cache = CandidateCache(tmp_path / "cache")
    keys = ensure_candidates(ctx, menus, im, cache)

    # (d) one step of the real loss: every gate gets a gradient
    teacher = copy.deepcopy(ctx.model).eval()
    from voodoo.pipeline import build_student
    mixed = build_student(ctx, menus, keys, cache)
    for mw in mixed.values():
        with torch.no_grad():
            mw.logits.normal_(0, 0.5)
    ids = tokens[:1, :64]
    with torch.no_grad():
        t_logits = _logits(teacher, ids)
    ce, kl = distill_losses(_logits(ctx.model, ids), t_logits, ids)
    (ce + kl).backward()
    dead = [n for n, mw in mixed.items() if mw.logits.grad is None or
            not torch.any(mw.logits.grad != 0)]
    assert not dead, f"{family}: gates without gradient: {dead}"

    # (b) exported bytes == llama-quantize with the written tensor-type file and imatrix
    asg = _assignment(ctx, menus, table)
    from voodoo.imatrix import quantize_imatrix_kv
    out = export(ctx, asg, keys, cache, tmp_path / f"{family}.gguf",
                 extra_kv=quantize_imatrix_kv(tmp_path / "imatrix.gguf"))
    ttf = out.with_suffix(".tensor-types.txt")
    ref = tmp_path / "ref.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix",
                        str(tmp_path / "imatrix.gguf"), "--tensor-type-file", str(ttf),
                        str(ctx.prepared.base_gguf), str(ref), "Q8_0"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace")
    assert r.returncode == 0, r.stdout[-3000:]
    # the quantize.imatrix.* keys as llama-quantize writes them: values and GGUF types
    kv_mine, kv_theirs = ({k: (f.types, f.contents()) for k, f in read_gguf(str(g)).fields.items()
                           if k.startswith("quantize.imatrix.")} for g in (out, ref))
    assert len(kv_theirs) >= 3 and kv_mine == kv_theirs, (kv_mine, kv_theirs)
    mine = {t.name: t for t in read_gguf(str(out)).tensors}
    theirs = {t.name: t for t in read_gguf(str(ref)).tensors}
    types = assignment_types(asg)
    assert len(set(types.values())) > 1
    for name, t in types.items():
        a, b = mine[name], theirs[name]
        assert a.tensor_type.name == b.tensor_type.name == t, (name, a.tensor_type, t)
        assert np.array_equal(np.asarray(a.data).view(np.uint8),
                              np.asarray(b.data).view(np.uint8)), f"{family} {name}"

    # (c) llama.cpp on the export agrees with the torch student of the same assignment. With
    # quantized weights llama.cpp also quantizes the activations of each matmul to 8 bits
    # (Q8_0/Q8_K dot products), which the torch student (float32 activations) does not: that
    # noise floor is measured on the mixed export (bounds MIXED_*); the bounds
    # (KLD <= 0.01, same top-1 >= 95%) hold on an all-F16 export through the same map, where
    # llama.cpp's activations are F16.
    _, _, logits = _student_logits(ctx, ctx.tmap, menus, keys, cache, asg, tokens)
    res_mixed = llama_vs_torch(out, logits, tokens, threads=1)
    assert res_mixed["kld_mean"] <= MIXED_KLD and res_mixed["same_top_p"] >= MIXED_SAME_TOP, \
        (family, {k: res_mixed[k] for k in ("kld_mean", "kld_99", "same_top_p")})
    f16 = {s.gguf_name: ["F16"] for s in ctx.specs}
    keys16 = ensure_candidates(ctx, f16, im, cache)
    asg16 = _assignment(ctx, f16, bytes_table(ctx.specs, f16))
    out16 = export(ctx, asg16, keys16, cache, tmp_path / f"{family}-f16.gguf")
    _, _, logits16 = _student_logits(ctx, ctx.tmap, f16, keys16, cache, asg16, tokens)
    res = llama_vs_torch(out16, logits16, tokens, threads=1)
    assert res["kld_mean"] <= MAX_KLD and res["same_top_p"] >= MIN_SAME_TOP, \
        (family, {k: res[k] for k in ("kld_mean", "kld_99", "same_top_p")})
    # ... and a deliberately wrong map fails the same check
    bad, what = _wrong_map(ctx.tmap)
    _, _, bad_logits = _student_logits(ctx, bad, f16, keys16, cache, asg16, tokens)
    res_bad = llama_vs_torch(out16, bad_logits, tokens, threads=1)
    assert res_bad["kld_mean"] > max(WRONG_KLD, 10 * res["kld_mean"]), (family, what, res_bad)
    print(f"{family}: {len(ctx.tmap)} tensors; mixed export KLD {res_mixed['kld_mean']:.2e} "
          f"same top {res_mixed['same_top_p']:.3f}; F16 export KLD {res['kld_mean']:.2e} same "
          f"top {res['same_top_p']:.3f}; wrong map ({what}): KLD {res_bad['kld_mean']:.3f}")
