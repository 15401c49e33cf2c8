"""voodoo chat / voodoo serve, end to end on the tiny model: a Voodoo GGUF (written by
export_gguf with the provenance the CLI records) answers with llama-completion, side by side
with its reference found through voodoo.model; llama-server answers a request on 127.0.0.1
and stops by itself. Slow: needs llama-completion and llama-server (`voodoo bootstrap`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from voodoo.ggufio import read_gguf

import cython_ggml
from voodoo.llamacpp import LlamaCppNotBuilt, tool_path

pytestmark = pytest.mark.slow


def _need(name):
    try:
        return tool_path(name)
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_voodoo_gguf(tiny_prepared, tmp_path_factory):
    """The tiny model with every matrix in Q8_0, its voodoo.* KV as `voodoo export` writes
    them (the model's name@sha256 indexed in the user's cache)."""
    from voodoo import cli
    from voodoo.export import export_gguf
    base = tiny_prepared.base_gguf
    tensors = {t.name: t for t in read_gguf(base).tensors}
    types = {n: "Q8_0" for n, t in tensors.items() if len(t.shape) == 2}

    def lookup(name, t):
        w = np.ascontiguousarray(np.asarray(tensors[name].data, dtype=np.float32))
        return cython_ggml.quantize(w, t, None, tensor_name=name)
    kv = cli._provenance(SimpleNamespace(model=str(tiny_prepared.hf_dir)),
                         {"budget_bytes": 1, "total_bytes": 1}, tiny_prepared)
    out = tmp_path_factory.mktemp("chat") / f"{tiny_prepared.name}.Voodoo100_Q8_0.gguf"
    return export_gguf(base, types, lookup, out, extra_kv=kv)


def test_generate_is_greedy_and_deterministic(tiny_voodoo_gguf):
    _need("llama-completion")
    from voodoo.chat import generate
    a = generate(tiny_voodoo_gguf, "Hello", n_predict=8, ctx=256)
    b = generate(tiny_voodoo_gguf, "Hello", n_predict=8, ctx=256)
    assert a.templated                       # the GGUF has a chat template: -cnv -st
    assert a.text and a.text == b.text
    assert "Hello" not in a.text[:5]         # the prompt is not echoed
    assert a.cut                             # a random model runs to --n_predict


def test_an_answer_cut_at_n_predict_is_marked(tiny_voodoo_gguf, monkeypatch, capsys):
    """An answer llama.cpp stopped at --n_predict read as if the model had finished; it now
    ends with a marker. Whether it was cut comes from llama-completion's own count of
    generated tokens ("eval time = ... / N runs", N + 1 tokens with the prompt's first)."""
    _need("llama-completion")
    import subprocess

    from voodoo import chat
    reps = chat.side_by_side(tiny_voodoo_gguf, "Hello", None, n_predict=8, ctx=256)
    assert reps[0].cut and capsys.readouterr().out.rstrip().endswith(
        "[... cut at --n_predict 8]")
    real = subprocess.run
    ended = ("common_perf_print:        eval time =      33.97 ms /     7 runs   (    4.85 ms "
             "per token,   206.04 tokens per second)\n")   # "The capital of France is Paris."

    def run(*a, **k):
        r = real(*a, **k)
        return subprocess.CompletedProcess(r.args, 0, r.stdout, ended)
    monkeypatch.setattr(chat.subprocess, "run", run)
    assert not chat.generate(tiny_voodoo_gguf, "Hello", n_predict=64, ctx=256).cut
    assert chat.generate(tiny_voodoo_gguf, "Hello", n_predict=8, ctx=256).cut


def test_voodoo_chat_reference_side_by_side(tiny_voodoo_gguf, tiny_prepared, capsys):
    _need("llama-completion")
    from voodoo import cli
    rc = cli.main(["chat", "--gguf", str(tiny_voodoo_gguf), "--reference", "--prompt", "Hi",
                   "--n_predict", "8", "--ctx", "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    blocks = out.split("\n--- ")
    assert blocks[0].strip() == "prompt: Hi"
    assert blocks[1].startswith(f"quantized: {tiny_voodoo_gguf.name} (")
    ref = Path(tiny_prepared.reference_gguf).name
    assert blocks[2].startswith(f"reference: {ref} (")
    for b in blocks[1:]:
        head, text = b.split("\n", 1)
        assert "greedy, chat template" in head
        assert text.strip(), b                # each model generated something


def test_chat_without_a_known_reference_says_what_to_do(tiny_voodoo_gguf, tmp_path,
                                                        monkeypatch, capsys):
    from voodoo import cli
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "empty-cache"))
    rc = cli.main(["chat", "--gguf", str(tiny_voodoo_gguf), "--reference"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "which this machine's Voodoo cache does not know; pass --model" in err


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def test_server_answers_and_stops(tiny_voodoo_gguf):
    _need("llama-server")
    from voodoo.chat import LlamaServer, complete
    with LlamaServer(tiny_voodoo_gguf, ctx=256) as srv:
        assert srv.host == "127.0.0.1"
        got = complete(srv.url, "Hello", n_predict=6)
        assert got["content"] and got["tokens_predicted"] >= 1
        oai = _post(srv.url + "/v1/completions",
                    {"prompt": "Hello", "max_tokens": 6, "temperature": 0})
        assert oai["object"] == "text_completion" and oai["choices"][0]["text"]
        pid = srv.proc.pid
        assert srv.log.is_file()                # its own temporary log ...
    assert srv.proc.poll() is not None          # stopped on leaving the block
    assert not srv.log.exists()                 # ... deleted with it (no litter in /tmp)
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url + "/health", timeout=2)
    assert pid


def test_voodoo_serve_answers_on_localhost_and_stops_by_itself(tiny_voodoo_gguf):
    _need("llama-server")
    from voodoo.chat import free_port
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "voodoo.cli", "serve", "--gguf",
                          str(tiny_voodoo_gguf), "--port", str(port), "--ctx", "256",
                          "--stop_after", "40"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()               # printed once /health answers
        assert first.startswith(f"serving {tiny_voodoo_gguf.name} at http://127.0.0.1:{port}"),\
            first + p.stdout.read()
        ans = _post(f"http://127.0.0.1:{port}/completion",
                    {"prompt": "Hello", "n_predict": 6, "temperature": 0})
        assert ans["content"]
        rest, _ = p.communicate(timeout=120)      # --stop_after: it ends by itself
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, rest
    assert "stopped llama-server" in rest
    assert time.monotonic() - t0 < 160
    # voodoo serve's log is the user's (its path is printed): kept; the test removes it
    import tempfile
    log = Path(tempfile.gettempdir()) / f"llama-server-{port}.log"
    assert str(log) in first and log.is_file()
    log.unlink()


def test_eval_without_shared_text_measures_on_the_eval_split(tiny_voodoo_gguf, tiny_model_dir,
                                                             tmp_path, monkeypatch, capsys):
    """`voodoo eval --gguf F` where ../shared/data/wikitext-2-raw-test.txt is absent: what
    --eval_text's help says -- the decoded eval blocks, written to
    <output_dir>/eval/eval-split.txt -- and a KLD row, instead of an error."""
    _need("llama-perplexity")
    from voodoo import cli
    monkeypatch.setattr(cli, "_default_eval_text", lambda: None)
    words = ("the river runs past old stone mills where farmers bring grain each autumn and "
             "children count the boats that pass under the bridge before the first snow").split()
    rng = np.random.default_rng(0)
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n\n".join(" ".join(rng.choice(words, 60)) + "." for _ in range(60)))
    out = tmp_path / "run"
    rc = cli.main(["eval", "--gguf", str(tiny_voodoo_gguf), "--model", str(tiny_model_dir),
                   "--data_name", str(src), "--seq_len", "64", "--n_train_blocks", "2",
                   "--n_eval_blocks", "8", "--ctx", "64", "--chunks", "4",
                   "--output_dir", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    split = out / "eval" / "eval-split.txt"
    assert split.is_file() and len(split.read_text().split()) > 100
    assert f"measuring on the eval split of {src}" in cap.err
    row = next(l for l in cap.out.splitlines() if l.startswith(f"| {tiny_voodoo_gguf.name}"))
    kld = float(row.split("|")[4])
    assert 0 <= kld < 1.0       # Q8_0 of a tiny random model against its F32 reference


def test_a_killed_driver_leaves_no_llama_server(tiny_voodoo_gguf, tmp_path):
    """`kill -9` of `voodoo serve` left llama-server running, holding its port (a new user's
    report; SIGINT/SIGTERM stopped it). The server now gets SIGTERM when its parent dies."""
    _need("llama-server")
    import signal

    from voodoo.chat import LlamaServer, port_in_use
    pidfile = tmp_path / "server.pid"
    code = ("import sys, time\nfrom voodoo.chat import LlamaServer\n"
            f"srv = LlamaServer({str(tiny_voodoo_gguf)!r}, ctx=256, "
            f"log={str(tmp_path / 'server.log')!r}).start()\n"   # kill -9: nobody deletes it
            f"open({str(pidfile)!r}, 'w').write(f'{{srv.proc.pid}} {{srv.port}}')\n"
            "time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 180
        while not pidfile.is_file() or not pidfile.read_text().strip():
            assert driver.poll() is None and time.monotonic() < deadline, "server never up"
            time.sleep(0.5)
        pid, port = map(int, pidfile.read_text().split())
        assert port_in_use("127.0.0.1", port)
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and \
                "zombie" not in Path(f"/proc/{pid}/status").read_text(errors="replace"):
            assert time.monotonic() < deadline, "llama-server outlived its killed parent"
            time.sleep(0.5)
        assert not port_in_use("127.0.0.1", port)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert LlamaServer(tiny_voodoo_gguf, host="::1", port=8080).url == "http://[::1]:8080"


def test_chat_reference_of_another_model_warns(tiny_voodoo_gguf, tiny_prepared, capsys):
    """`voodoo chat --reference --model <other model>` answered beside the wrong reference
    without a word (a new user's report; `voodoo eval` warns). The GGUF's recorded model is
    compared with --model's reference, as eval does."""
    from voodoo import cli
    a = SimpleNamespace(model=str(tiny_voodoo_gguf), gguf=str(tiny_voodoo_gguf))
    assert cli._reference_of(a) == tiny_voodoo_gguf      # another GGUF as the reference
    err = capsys.readouterr().err
    assert f"warning: {tiny_voodoo_gguf.name} was made from" in err, err
    assert "shown beside it as the reference" in err, err
    a = SimpleNamespace(model=str(tiny_prepared.reference_gguf), gguf=str(tiny_voodoo_gguf))
    cli._reference_of(a)                                  # its own reference: no warning
    assert "warning" not in capsys.readouterr().err


def test_a_voodoo_gguf_as_model_is_noted(tiny_voodoo_gguf, tiny_prepared, capsys):
    """`voodoo doctor --model <a Voodoo output>` said "all good" and took it as a new model
    named `voodoo` without a word (a new user's report). Allowed, with a note naming the model
    it was made from; a plain model GGUF gets none."""
    from voodoo.cli import _check_model_early
    _check_model_early(str(tiny_voodoo_gguf))
    err = capsys.readouterr().err
    assert f"--model {tiny_voodoo_gguf.name} is a file Voodoo wrote (from " in err, err
    _check_model_early(str(tiny_prepared.reference_gguf))
    assert "Voodoo wrote" not in capsys.readouterr().err


def test_a_server_that_fails_to_start_keeps_its_log(tmp_path):
    """A llama-server that exits before answering (here: a GGUF with no tensors) is reported
    with its log's tail and path, and that log is kept for the user."""
    _need("llama-server")
    from gguf import GGUFWriter

    from voodoo.chat import ChatError, LlamaServer
    gguf = tmp_path / "empty.gguf"
    w = GGUFWriter(str(gguf), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    srv = LlamaServer(gguf, ctx=256)
    with pytest.raises(ChatError, match="before answering") as ei:
        srv.start(timeout=60)
    assert f"log: {srv.log}" in str(ei.value) and srv.log.is_file()
    srv.stop()
    assert srv.log.is_file()
    srv.log.unlink()
