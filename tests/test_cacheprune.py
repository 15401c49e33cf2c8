"""``voodoo doctor --prune_cache DAYS``: what goes and what stays (voodoo/cacheprune.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from voodoo.cacheprune import cache_entries, prune_cache

DAY = 86400.0


def _file(p: Path, nbytes: int, age_days: float, now: float) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * nbytes)
    t = now - age_days * DAY
    os.utime(p, (t, t))
    return p


def _tree(root: Path, now: float) -> dict[str, Path]:
    """A cache with old and recent entries of every prunable kind."""
    f = {}
    f["cand_old"] = _file(root / "candidates" / "Q4_K" / "a.arrow", 100, 40, now)
    f["cand_new"] = _file(root / "candidates" / "Q4_K" / "b.arrow", 200, 1, now)
    f["cand_old2"] = _file(root / "candidates" / "IQ4_NL" / "c.arrow", 300, 10, now)
    # a model folder: its newest file decides (the base converted long ago, read yesterday)
    f["model_used"] = _file(root / "models" / "k1" / "base-f32.gguf", 1000, 60, now)
    _file(root / "models" / "k1" / "source.json", 10, 1, now)
    f["model_old"] = _file(root / "models" / "k2" / "base-f32.gguf", 2000, 30, now)
    f["index"] = _file(root / "models" / "by-sha256" / "ab.json", 10, 99, now)
    # kld: a .kld and its .json go together; the .json was read recently
    f["kld"] = _file(root / "kld" / "k.kld", 500, 20, now)
    f["kld_json"] = _file(root / "kld" / "k.json", 5, 2, now)
    f["fisher"] = _file(root / "fisher" / "fisher-1.pt", 700, 8, now)
    f["text"] = _file(root / "texts" / "t.123.txt", 50, 9, now)
    f["build_pin"] = _file(root / "llama.cpp" / "PIN" / "bin" / "llama-quantize", 90, 400, now)
    f["build_old"] = _file(root / "llama.cpp" / "OLD" / "bin" / "llama-quantize", 80, 40, now)
    f["download"] = _file(root / "downloads" / "wheel.whl", 60, 400, now)
    return f


def test_prune_removes_what_was_not_used_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("VOODOO_LLAMA_CPP_COMMIT", "PIN")
    now = time.time()
    root = tmp_path / "cache"
    f = _tree(root, now)
    kinds = sorted({e.kind for e in cache_entries(root)})
    assert kinds == ["candidates", "fisher", "kld", "llama.cpp", "models", "texts"]

    dry = prune_cache(root, 7, dry_run=True, now=now)
    gone = {p for e in dry.removed for p in e.paths}
    assert gone == {f["cand_old"], f["cand_old2"], root / "models" / "k2", f["fisher"],
                    f["text"], root / "llama.cpp" / "OLD"}
    assert dry.nbytes == 100 + 300 + 2000 + 700 + 50 + 80
    assert all(p.exists() for p in f.values())          # a dry run deletes nothing

    res = prune_cache(root, 7, now=now)
    assert {p for e in res.removed for p in e.paths} == gone
    assert not any(p.exists() for p in gone)
    for k in ("cand_new", "model_used", "index", "kld", "kld_json", "build_pin", "download"):
        assert f[k].exists(), k
    assert res.kept == 3 and res.kept_bytes == 200 + 1010 + 505   # the build in use: no entry
    assert not list(root.rglob(".*pruning*"))            # no renamed leftovers
    assert "6 entries" in res.summary() and "candidates 2" in res.summary()

    # everything prunable goes at 0 days, except the build in use and the index
    prune_cache(root, 0, now=now + 1)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == ["downloads/wheel.whl", "llama.cpp/PIN/bin/llama-quantize",
                    "models/by-sha256/ab.json"]
    with pytest.raises(ValueError, match=">= 0"):
        prune_cache(root, -1)
    # a linked folder in the cache: the link goes, never what it points to
    outside = tmp_path / "outside"
    _file(outside / "keep.arrow", 10, 99, now)
    (root / "candidates" / "Q4_K").mkdir(parents=True, exist_ok=True)
    (root / "candidates" / "LINKED").symlink_to(outside, target_is_directory=True)
    os.utime(root / "candidates" / "LINKED", (now - 99 * DAY,) * 2, follow_symlinks=False)
    res = prune_cache(root, 7, now=now)
    assert [e.paths[0].name for e in res.removed] == ["LINKED"]
    assert (outside / "keep.arrow").is_file() and not (root / "candidates" / "LINKED").exists()


def test_doctor_prune_cache_cli_and_a_pruned_reference_is_made_again(tiny_prepared, tmp_path,
                                                                     monkeypatch):
    """Through the CLI; then an index entry whose reference GGUF was pruned still finds the
    model, and preparing it converts the reference again (same bytes)."""
    from test_pipeline import run_cli

    from voodoo.export import find_model, record_model
    from voodoo.fsutil import sha256_file
    from voodoo.llamacpp import build_root, llama_cpp_commit
    from voodoo.models import prepare_model
    cache = tmp_path / "cache"
    (cache / "llama.cpp").mkdir(parents=True)
    # the build in use (its converter prepares the model below) is never pruned
    (cache / "llama.cpp" / llama_cpp_commit()).symlink_to(build_root())
    monkeypatch.setenv("VOODOO_CACHE", str(cache))
    now = time.time()
    _file(cache / "candidates" / "Q8_0" / "old.arrow", 10, 30, now)
    rc, out, err = run_cli(["doctor", "--prune_cache", "14", "--dry_run"])
    assert rc == 0, err
    assert "would delete" in out and "old.arrow" in out and "1 entries" in out
    assert (cache / "candidates" / "Q8_0" / "old.arrow").exists()
    rc, out, err = run_cli(["doctor", "--prune_cache", "14"])
    assert rc == 0 and "deleted" in out, err
    assert not (cache / "candidates" / "Q8_0" / "old.arrow").exists()
    rc, _, err = run_cli(["doctor", "--dry_run"])
    assert rc == 2 and "--dry_run goes with --prune_cache" in err
    rc, _, err = run_cli(["doctor", "--prune", "0"])   # no abbreviation deletes anything
    assert rc == 2 and "did you mean --prune_cache" in err

    prepared = prepare_model(str(tiny_prepared.hf_dir))   # converted into this cache
    ref = Path(prepared.reference_gguf)
    assert cache in ref.parents
    sha = sha256_file(ref)
    value = record_model(prepared, sha)
    rc, out, err = run_cli(["doctor", "--prune_cache", "0"])
    assert rc == 0, err
    assert not ref.exists()
    assert json.loads((cache / "models" / "by-sha256" / f"{sha}.json").read_text())
    found = find_model(value)
    assert found == str(Path(tiny_prepared.hf_dir).resolve())
    again = Path(prepare_model(found).reference_gguf)
    assert sha256_file(again) == sha


def test_a_folder_that_is_not_voodoos_cache_is_not_pruned(tmp_path, monkeypatch):
    """VOODOO_CACHE set to a project folder (or to "", which once meant the current folder)
    must not cost it its models/: prune refuses a root with neither CACHEDIR.TAG nor a
    llama.cpp/ build folder, and an empty VOODOO_CACHE means the default cache."""
    from voodoo.llamacpp import CACHE_TAG, cache_root, mark_cache
    now = time.time()
    project = tmp_path / "project"
    mine = _file(project / "models" / "my_experiment" / "weights.bin", 100, 60, now)
    with pytest.raises(ValueError, match="does not look like Voodoo's cache"):
        prune_cache(project, 30, now=now)
    assert mine.exists()
    mark_cache(project)
    assert (project / CACHE_TAG).read_text().startswith(
        "Signature: 8a477f597d28d172789f06886806bc55")
    assert [e.paths[0].name for e in prune_cache(project, 30, now=now).removed] == [
        "my_experiment"]
    monkeypatch.setenv("VOODOO_CACHE", "")
    assert cache_root() == Path("~/.cache/voodoo").expanduser().absolute()
    monkeypatch.setenv("VOODOO_CACHE", "rel/cache")
    assert cache_root() == Path.cwd() / "rel" / "cache"
