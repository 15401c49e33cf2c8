"""voodoo.candidates: keys, the Arrow IPC cache (round trip, corruption), precache_local."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import cython_ggml
from voodoo import candidates as C

TYPES = ("Q4_K", "IQ4_XS", "Q8_0")


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return {f"blk.{i}.ffn_up.weight": rng.standard_normal((64, 512)).astype(np.float32)
            for i in range(2)}


@pytest.fixture(scope="module")
def imatrix(weights):
    rng = np.random.default_rng(1)
    return {n: (rng.standard_normal(512) ** 2 + 0.1).astype(np.float32) for n in weights}


def _jobs(weights, imatrix):
    jobs = [(n, w, t, None) for n, w in weights.items() for t in TYPES]
    jobs += [(n, w, "IQ2_XXS", imatrix[n]) for n, w in weights.items()]
    return jobs


def test_round_trip_zero_copy(tmp_path, weights):
    name, w = next(iter(weights.items()))
    cache = C.CandidateCache(tmp_path)
    key = C.candidate_key(w, "Q4_K", None)
    assert cache.get(key) is None and key not in cache
    data = C.quantize_candidate(w, "Q4_K", None, name, n_threads=1)
    p = cache.put(key, data, name)
    assert p == cache.path(key) and p.is_file() and key in cache
    got = cache.get(key)
    assert got.dtype == np.uint8 and got.shape == (64, 288)
    np.testing.assert_array_equal(got, data)
    assert not got.flags.writeable  # a view of the memory-mapped file
    with pa.memory_map(str(p)) as src:
        table = pa.ipc.open_file(src).read_all()
    arr, meta = C.from_arrow(table)
    assert meta["gguf_name"] == name and meta["type"] == "Q4_K"
    assert (meta["n_rows"], meta["n_per_row"], meta["row_size"]) == (64, 512, 288)
    assert C.CandidateKey.from_meta(meta) == key
    # to_arrow/from_arrow share the buffer
    t = C.to_arrow(data, {"gguf_name": name})
    back, _ = C.from_arrow(t)
    assert np.shares_memory(back, data)


def test_a_file_from_before_the_rounding_field_is_still_valid(tmp_path, weights, recwarn):
    """A candidate written before CandidateKey.rounding existed (no "rounding" in its
    metadata; llama-quantize's bytes, same file name) is read, not declared corrupt and
    deleted: every user's cache was being thrown away and requantized, with two warning lines
    a candidate."""
    name, w = next(iter(weights.items()))
    cache = C.CandidateCache(tmp_path)
    key = C.candidate_key(w, "Q4_K", None)
    data = C.quantize_candidate(w, "Q4_K", None, name, n_threads=1)
    meta = {k: v for k, v in key.to_meta().items() if k != "rounding"}
    table = C.to_arrow(data, {**meta, "gguf_name": name, "type": key.type_name})
    p = cache.path(key)
    p.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(p), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as wr:
            wr.write_table(table)
    got = cache.get(key)
    assert got is not None and p.is_file()
    np.testing.assert_array_equal(got, data)
    assert not [x for x in recwarn if issubclass(x.category, C.CorruptCandidateWarning)]
    # a real difference in a field is still caught
    other = C.CandidateKey(**{**key.__dict__, "rounding": "gptq:0.01:abc"})
    assert C.CandidateKey.from_meta(meta) != other


def test_bytes_equal_cython_ggml(tmp_path, weights, imatrix):
    cache = C.CandidateCache(tmp_path)
    res = C.precache_local(_jobs(weights, imatrix), cache, progress=False, n_threads=1)
    for (name, t), key in res.items():
        im = imatrix[name] if t == "IQ2_XXS" else None
        want = cython_ggml.quantize(weights[name], t, imatrix=im, n_threads=2,
                                    tensor_name=name)
        np.testing.assert_array_equal(cache.get(key), want)


def test_second_run_quantizes_nothing(tmp_path, weights, imatrix, monkeypatch):
    cache = C.CandidateCache(tmp_path)
    jobs = _jobs(weights, imatrix)
    r1 = C.precache_local(jobs, cache, progress=False)
    assert (r1.hits, r1.misses, len(r1)) == (0, len(jobs), len(jobs))
    calls = []
    monkeypatch.setattr(C, "quantize_candidate", lambda *a, **k: calls.append(a))
    r2 = C.precache_local(jobs, cache, progress=True)
    assert (r2.hits, r2.misses, calls) == (len(jobs), 0, [])
    assert dict(r2) == dict(r1)


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_meta", "flip_magic",
                                    "empty"])
def test_corrupt_file_detected_and_rebuilt(tmp_path, weights, damage):
    name, w = next(iter(weights.items()))
    cache = C.CandidateCache(tmp_path)
    jobs = [(name, w, "IQ4_XS", None)]
    key = C.precache_local(jobs, cache, progress=False)[(name, "IQ4_XS")]
    good = np.array(cache.get(key))
    p = cache.path(key)
    raw = bytearray(p.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_data":
        i = raw.find(good[10].tobytes())  # a byte inside the rows
        assert i > 0
        raw[i + 5] ^= 0x01
    elif damage == "flip_meta":  # the tensor name in the footer's schema metadata
        i = raw.rfind(name.encode())
        raw[i + 2] ^= 0x01
    elif damage == "flip_magic":
        raw[-1] ^= 0xFF
    else:
        raw = bytearray()
    p.write_bytes(bytes(raw))
    with pytest.warns(C.CorruptCandidateWarning):
        assert cache.get(key) is None
    assert not p.exists()
    r = C.precache_local(jobs, cache, progress=False)
    assert r.misses == 1
    np.testing.assert_array_equal(cache.get(key), good)


def test_key_changes(weights, imatrix, monkeypatch):
    name, w = next(iter(weights.items()))
    im = imatrix[name]
    k = C.candidate_key(w, "Q4_K", None)
    assert k.type_name == "Q4_K" and k.imatrix_sha256 == "none"
    assert C.candidate_key(w.copy(), "q4_k", None) == k  # content, not identity
    w2 = w.copy()
    w2[3, 7] = np.nextafter(w2[3, 7], np.float32(np.inf))
    assert C.candidate_key(w2, "Q4_K", None) != k
    assert C.candidate_key(w.reshape(128, 256), "Q4_K", None).weights_sha256 != k.weights_sha256
    assert C.candidate_key(w, "IQ4_XS", None) != k
    ki = C.candidate_key(w, "Q4_K", im)
    assert ki != k and ki.imatrix_sha256 == C.imatrix_sha256(im)
    im2 = im.copy()
    im2[0] *= 2
    assert C.candidate_key(w, "Q4_K", im2) != ki
    monkeypatch.setenv("VOODOO_LLAMA_CPP_COMMIT", "deadbeef")
    kc = C.candidate_key(w, "Q4_K", None)
    assert kc != k and kc.llama_cpp_commit == "deadbeef"
    assert len({x.digest for x in (k, ki, kc)}) == 3


def test_imatrix_rules(weights):
    name, w = next(iter(weights.items()))
    with pytest.raises(ValueError, match="importance matrix"):
        C.quantize_candidate(w, "IQ2_XXS", None, name)
    with pytest.raises(ValueError, match="entries"):
        C.quantize_candidate(w, "Q4_K", np.ones(256, np.float32), name)
    # llama-quantize ignores a wrong-size entry for token_embd only
    a = C.quantize_candidate(w, "Q4_K", np.ones(256, np.float32), "token_embd.weight")
    np.testing.assert_array_equal(a, cython_ggml.quantize(w, "Q4_K"))
    with pytest.raises(TypeError):
        C.candidate_key(w.astype(np.float16), "Q4_K", None)
    with pytest.raises(ValueError):  # 500 is not a multiple of 256
        C.plan_precache([(name, np.zeros((4, 500), np.float32), "Q4_K", None)],
                        C.CandidateCache("/nonexistent"))


def test_precache_summary_says_which_bytes():
    """The two precache lines of --rounding auto (llama-quantize's bytes, then the
    error-feedback ones) differ in what they say, not only in their timing."""
    from types import SimpleNamespace

    from voodoo.candidates import PrecacheResult
    g = PrecacheResult({("a", "Q4_K"): SimpleNamespace(rounding="ggml"),
                        ("b", "Q4_K"): SimpleNamespace(rounding="ggml")})
    f = PrecacheResult({("a", "Q4_K"): SimpleNamespace(rounding="gptq"),
                        ("b", "Q4_K"): SimpleNamespace(rounding="ggml")})
    g.hits = f.hits = 2
    assert g.summary().startswith("2 candidates: 2 cached, 0 quantized in ")
    assert f.summary().startswith("2 candidates (1 with error-feedback bytes): 2 cached")


# ------------------------------------------------- 3-D tensors: one imatrix vector per slice
def _tiny_gguf_with_3d(path, w3, n_embd=64, n_vocab=32):
    """A one-layer llama GGUF with random F32 weights plus MLA's 3-D ``blk.0.attn_k_b.weight``
    (numpy (n_head, ne1, ne0) = GGUF ne [ne0, ne1, n_head]): enough for llama-quantize."""
    import gguf
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64),
                   (w.add_embedding_length, n_embd), (w.add_feed_forward_length, 128),
                   (w.add_head_count, 2), (w.add_head_count_kv, 2),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_file_type, 0),
                   (w.add_vocab_size, n_vocab), (w.add_rope_dimension_count, n_embd // 2)):
        add(v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_types([1] * n_vocab)
    w.add_token_merges(["t 1"])
    f = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_k_b.weight", w3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["Q4_0", "IQ4_NL"])
def test_3d_tensor_per_slice_imatrix_matches_llama_quantize(tmp_path, type_name):
    """MLA's attn_k_b / attn_v_b (DeepSeek-V2/V3, Kimi) are 3-D (ne0, ne1, n_head);
    llama-imatrix writes one flat entry of ne0*n_head values for them and llama-quantize uses
    values [i*ne0, (i+1)*ne0) for head i. Voodoo's candidate (the heads' rows stacked) is
    byte-identical to llama-quantize's tensor, and differs from using one vector for all."""
    import subprocess

    from voodoo.ggufio import read_gguf
    from voodoo.imatrix import read_imatrix, write_imatrix_gguf
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        exe = str(tool_path("llama-quantize"))
    except LlamaCppNotBuilt as e:
        pytest.skip(f"llama-quantize not built: {e}")
    name, (n_head, ne1, ne0) = "blk.0.attn_k_b.weight", (4, 64, 32)
    rng = np.random.default_rng(7)
    w3 = rng.standard_normal((n_head, ne1, ne0)).astype(np.float32)
    base = _tiny_gguf_with_3d(tmp_path / "base.gguf", w3)
    # very different importances per head, flat as llama-imatrix writes them (counts [1])
    sums = (rng.random(n_head * ne0) ** 6 * 1e3 + 1e-3).astype(np.float32)
    imf = write_imatrix_gguf(tmp_path / "im.gguf", {name: sums}, {name: 1}, ["unit-test"], 1, 64)
    row = read_imatrix(imf)[name]
    assert row.shape == (n_head * ne0,)
    ttf = tmp_path / "types.txt"
    ttf.write_text(f"{name}={type_name.lower()}\n")
    out = tmp_path / "q.gguf"
    r = subprocess.run([exe, "--imatrix", str(imf), "--tensor-type-file", str(ttf), str(base),
                        str(out), "Q8_0", "1"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, errors="replace")
    assert r.returncode == 0, r.stdout[-3000:]
    t = {x.name: x for x in read_gguf(str(out)).tensors}[name]
    assert t.tensor_type.name == type_name
    theirs = np.asarray(t.data).view(np.uint8).reshape(-1)

    w2 = np.ascontiguousarray(w3.reshape(n_head * ne1, ne0))   # GGUF layout, heads stacked
    im = C.effective_imatrix(row, name, ne0)
    assert im.shape == (n_head, ne0)
    mine = C.quantize_candidate(w2, type_name, row, name, n_threads=1)
    np.testing.assert_array_equal(mine.reshape(-1), theirs)
    one = cython_ggml.quantize(w2, type_name, imatrix=np.ascontiguousarray(im[0]), n_threads=1)
    assert not np.array_equal(one.reshape(-1), theirs)  # the per-head vectors matter
    # through the cache too, with a key distinct from one vector's
    cache = C.CandidateCache(tmp_path / "cache")
    res = C.precache_local([(name, w2, type_name, row)], cache, progress=False, n_threads=1)
    np.testing.assert_array_equal(cache.get(res[(name, type_name)]).reshape(-1), theirs)


def test_per_slice_imatrix_rules():
    """An entry of k * n_per_row values is k per-slice vectors; other sizes are refused (but
    not for token_embd, which llama-quantize lets go without one); the rows must split into k
    slices; error-feedback rounding is not asked of such a tensor."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 32)).astype(np.float32)
    flat = (rng.random(4 * 32) + 0.1).astype(np.float32)
    got = C.effective_imatrix(flat, "blk.0.attn_k_b.weight", 32)
    assert got.shape == (4, 32) and np.array_equal(got.reshape(-1), flat)
    assert C.effective_imatrix(flat.reshape(4, 32), "blk.0.ffn_up_exps.weight", 32).shape \
        == (4, 32)
    assert C.effective_imatrix(flat[:32], "x.weight", 32).shape == (32,)
    assert C.effective_imatrix(flat[None, :32], "x.weight", 32).shape == (32,)
    with pytest.raises(ValueError, match="not a multiple") as e:
        C.effective_imatrix(flat[:40], "blk.0.attn_k_b.weight", 32)
    assert "refuses" not in str(e.value)
    assert C.effective_imatrix(flat, "token_embd.weight", 32) is None
    assert C.effective_imatrix(flat[:40], "token_embd.weight", 32) is None
    with pytest.raises(ValueError, match="do not split into the 3 slices"):
        C.quantize_candidate(np.ones((8, 32), np.float32), "Q8_0", flat[:96], "x.weight")
    # per-slice vectors for 4 heads of 2 rows each: the slices' own bytes
    a = C.quantize_candidate(w, "IQ4_NL", flat, "blk.0.attn_k_b.weight", n_threads=1)
    b = np.concatenate([cython_ggml.quantize(np.ascontiguousarray(w[2 * i:2 * i + 2]), "IQ4_NL",
                                             imatrix=np.ascontiguousarray(flat[32 * i:32 * (i + 1)]),
                                             n_threads=1) for i in range(4)])
    np.testing.assert_array_equal(a, b)
    # with a Hessian (--rounding gptq / auto) such a tensor keeps llama-quantize's rounding
    h = np.eye(32, dtype=np.float32)
    res, todo = C.plan_precache([C.CandidateJob("blk.0.attn_k_b.weight", w, "IQ4_NL", flat, h),
                                 C.CandidateJob("x.weight", w, "IQ4_NL", flat[:32], h)],
                                C.CandidateCache("/nonexistent"))
    assert res[("blk.0.attn_k_b.weight", "IQ4_NL")].rounding == "ggml"
    assert res[("x.weight", "IQ4_NL")].rounding.startswith("gptq:")
    assert [j.hessian is None for j, _ in todo] == [True, False]


def test_quantize_bar_moves_with_the_work_not_the_count(capsys):
    """The quantize bar advances by each candidate's estimated cost (libggml's IQ1_S takes
    about 1,500 times Q8_0's time a weight; an error-feedback 32-block type's time grows with
    the row's length), so a cheap first candidate no longer reads as half the work, and the
    ETA of a run that starts with the slowest candidate is not hours off; the postfix still
    counts candidates."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    todo = [(C.CandidateJob("blk.0.ffn_up.weight", w, t, None), C.candidate_key(w, t, None))
            for t in ("Q8_0", "IQ1_S")]
    bar = C._progress(todo, "quantize", True)
    bar.done(0, "blk.0.ffn_up.weight Q8_0")
    assert bar.bar.n < 5 and "1/2" in bar.bar.postfix       # a count would say 50%
    bar.done(1, "blk.0.ffn_up.weight IQ1_S")
    assert bar.bar.n == pytest.approx(100) and "2/2" in bar.bar.postfix
    bar.close()
    # every type libggml quantizes has its own speed (a new type is not silently a guess)
    from voodoo.quants import TYPES
    quantizable = list(TYPES)
    assert {"Q8_0", "IQ1_S", "Q4_K"} <= set(quantizable)
    assert sorted(set(quantizable) - set(C.QUANTIZE_NS)) == []
    # error-feedback rounding of a 32-block type costs more a weight on longer rows
    h = np.eye(512, dtype=np.float32)
    job = C.CandidateJob("blk.0.ffn_up.weight", w, "Q5_0", None, h)
    short = C.CandidateJob("blk.0.ffn_up.weight", w.reshape(128, 256), "Q5_0", None, h[:256, :256])
    key = C.candidate_key(w, "Q5_0", None, rounding=C.rounding_tag(h, "Q5_0"))
    key_short = C.candidate_key(short.weights, "Q5_0", None,
                                rounding=C.rounding_tag(h[:256, :256], "Q5_0"))
    assert key.rounding != "ggml"
    assert C.job_cost(job, key) > 1.5 * C.job_cost(short, key_short)
