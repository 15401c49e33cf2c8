"""The end of ``voodoo run``: the Voodoo GGUF beside stock llama.cpp file types (quantized by
``llama-quantize`` from the same base F32 GGUF with the same imatrix), every file measured by
``llama-perplexity`` against the reference model, and where the wall time went."""

from __future__ import annotations

import json
from pathlib import Path

from .pipeline import log, write_json


def gguf_bpw(path) -> tuple[int, float]:
    """(tensor bytes, bits per weight over all tensors) of a GGUF file."""
    from .ggufio import read_gguf
    r = read_gguf(path)
    nbytes = sum(int(t.n_bytes) for t in r.tensors)
    n = sum(int(t.n_elements) for t in r.tensors)
    return nbytes, 8.0 * nbytes / n


def stock_file(base_gguf, ftype: str, imatrix_file, out_dir) -> Path:
    """``llama-quantize --imatrix I base out FTYPE``, kept in ``out_dir`` as
    ``stock.<FTYPE>.gguf`` and reused only when made from the same base F32 GGUF, imatrix and
    llama.cpp (sha256s recorded in ``out_dir/provenance.json``, :mod:`voodoo.provenance`);
    a file made from other inputs is quantized again, and the log says so."""
    from .export import quantize_with_llama
    from .llamacpp import llama_cpp_commit
    from .provenance import check, describe, file_sha256, record
    out = Path(out_dir) / f"stock.{ftype}.gguf"
    inputs = {"base": file_sha256(base_gguf),
              "imatrix": file_sha256(imatrix_file) if imatrix_file else "none",
              "ftype": ftype, "llama_cpp_commit": llama_cpp_commit()}
    diff = check(out_dir, out.name, inputs)
    if diff:
        log(f"{out} was not made for this run ({describe(out_dir, out.name, inputs, diff)}); "
            f"quantizing it again")
    elif diff == []:  # the same inputs: reused only if the file is whole (a copy, a full disk)
        from .ggufio import read_gguf
        try:
            read_gguf(out)
        except (ValueError, OSError) as e:
            log(f"{out} is damaged ({e}); quantizing it again")
            diff = ["damaged"]
    if diff is None or diff:
        log(f"llama-quantize {ftype}")
        quantize_with_llama(base_gguf, out, imatrix_file=imatrix_file, default_type=ftype)
        record(out_dir, out.name, inputs)
    return out


def compare_with_stock(r) -> list[dict]:
    """Quantizes ``r.a.stock_types``, evaluates them, the Voodoo GGUF and the reference with
    llama-perplexity (``--kl-divergence`` against the reference), prints the table and the
    timing, and writes ``<output_dir>/eval/report.{json,md}``. Returns the rows."""
    from .cli import _default_eval_text, _write_eval_split
    from .evaluate import format_table, run_perplexity, save_report
    a, out = r.a, r.out
    text = Path(a.eval_text) if a.eval_text else _default_eval_text()
    if text is None:
        text = _write_eval_split(r)
    ref = r.ctx.prepared.reference_gguf
    files = [("Voodoo", r.gguf)]
    with r.timer("stock llama-quantize"):
        for ft in [t for t in a.stock_types.replace(",", " ").split() if t]:
            files.append((f"stock {ft}", stock_file(r.ctx.prepared.base_gguf, ft,
                                                     r.imatrix_path, out / "stock")))
    rows = []
    with r.timer("llama-perplexity"):
        for label, f in files:
            res = run_perplexity(f, text, ctx=a.ctx, chunks=a.chunks, kl_base=ref)
            nbytes, bpw = gguf_bpw(f)
            rows.append({"file": label, "name": Path(f).name, "size_mib": f.stat().st_size / 2**20,
                         "bpw": bpw, "ppl": res.get("ppl"), "kld": res.get("kld"),
                         "kld_p99_9": res.get("kld_p99_9"), "same_top_p": res.get("same_top_p"),
                         "ppl_base": res.get("ppl_base")})
    rows.sort(key=lambda x: x["size_mib"])
    cols = ["file", "name", "size_mib", "bpw", "ppl", "kld", "kld_p99_9", "same_top_p",
            "ppl_base"]
    base_ppl = next((x["ppl_base"] for x in rows if x.get("ppl_base")), None)
    from .llamatext import text_note
    header = (f"llama-perplexity -c {a.ctx} --chunks {a.chunks} on {text.name}"
              f"{text_note(ref, text)}; KLD vs "
              f"{Path(ref).name}" + (f" (PPL {base_ppl:.4f})" if base_ppl else ""))
    print(f"\n{header}\n")
    print(format_table(rows, cols))
    print("\nwall time\n")
    print(r.timer.report())
    save_report(rows, out / "eval" / "report.json", cols, title=header)
    from .cli import EVAL_TEXT_RECORD   # `voodoo eval --gguf` of this folder scores it again
    from .fsutil import sha256_file
    write_json(out / EVAL_TEXT_RECORD, {"path": str(Path(text).resolve()), "ctx": a.ctx,
                                         "chunks": a.chunks, "bytes": Path(text).stat().st_size,
                                         "sha256": sha256_file(text)})
    write_pictures(r, rows, out / "eval", text_name=text.name)
    write_json(out / "eval" / "timing.json", timing_history(out / "eval" / "timing.json",
                                                            r.timer.stages))
    print(f"report: {out / 'eval' / 'report.md'} (and report.json, timing.json)")
    if text.name == "eval-split.txt":
        print("this table scored the calibration corpus's held-out split; to score another "
              "text (e.g. WikiText-2's test text), run the same command again with --eval_text "
              "FILE added (`bash scripts/main.sh --eval_text FILE` for the main job): it reuses "
              "the trained gates and redoes only the export and llama-perplexity")
    return rows


def timing_history(path: Path, stages: dict[str, float]) -> dict:
    """``eval/timing.json`` with this run's stage times (seconds) in ``stages`` and every earlier
    run of the folder kept in ``history`` (oldest first, each ``{"finished", "stages"}``), so a
    resumed or repeated ``voodoo run`` does not lose the first run's timing. An unreadable or
    old-format file (a bare ``{stage: seconds}``) becomes the first history entry."""
    import datetime as _dt
    history: list = []
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and "stages" in old:
        history = list(old.get("history") or []) + [
            {"finished": old.get("finished"), "stages": old["stages"]}]
    elif isinstance(old, dict) and old:
        history = [{"finished": None, "stages": old}]
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return {"finished": now, "stages": dict(stages), "history": history}


def write_pictures(r, rows, eval_dir, text_name: str | None = None) -> list[Path]:
    """``<eval_dir>/assignment.png`` (blocks x tensor kinds, coloured by ggml type) and
    ``<eval_dir>/size_vs_kld.png`` (the run against the stock types; ``text_name``, the text
    llama-perplexity scored, goes into its title), next to report.md. Returns the paths
    written."""
    from .evaluate import plot_assignment, plot_size_vs_kld
    name = getattr(r, "stem", None) or "Voodoo"
    paths = [plot_assignment(r.assignment, Path(eval_dir) / "assignment.png",
                             title=f"{name}: ggml type per tensor"),
             plot_size_vs_kld(rows, Path(eval_dir) / "size_vs_kld.png",
                              title=f"{r.ctx.prepared.name}: size vs mean KLD "
                                    f"(llama-perplexity -c {r.a.ctx}, {r.a.chunks} chunks"
                                    + (f" of {text_name})" if text_name else ")"))]
    print("pictures: " + ", ".join(str(p) for p in paths))
    return paths
