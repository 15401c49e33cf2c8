"""voodoo.train: config, schedule, data order, the loop, the journal and resume."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from voodoo.bake import bake
from voodoo.gates import install_gates, mixed_weights
from voodoo.quants import tensor_nbytes
from voodoo.train import (JOURNAL_NAME, CorruptJournalError, TrainConfig, batch_indices,
                          distill_losses, temperature_at, train_gates)

TYPES = ["Q8_0", "Q5_0", "Q4_0"]
SEQ = 16


def gated_llama(seed=0):
    """(student with gates, teacher, menus, bytes): a tied 2-layer Llama, candidates W + noise."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    teacher = copy.deepcopy(model)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "mlp.down_proj": "ffn_down", "mlp.up_proj": "ffn_up"}
    specs = [SimpleNamespace(gguf_name=f"blk.{i}.{g}.weight", module_name=f"model.layers.{i}.{h}",
                             tied_to=[]) for i in range(2) for h, g in names.items()]
    specs.append(SimpleNamespace(gguf_name="token_embd.weight", module_name="model.embed_tokens",
                                 tied_to=["lm_head"]))
    g = torch.Generator().manual_seed(seed + 1)
    cands, nbytes, menus = {}, {}, {}
    for s in specs:
        w = model.get_submodule(s.module_name).weight.detach()
        cands[s.gguf_name] = torch.stack([w + torch.randn(w.shape, generator=g) * 0.02 * 3 ** k
                                          for k in range(len(TYPES))])
        nbytes[s.gguf_name] = [tensor_nbytes(t, *w.shape) for t in TYPES]
        menus[s.gguf_name] = list(TYPES)
    install_gates(model, specs, cands, nbytes, menus=menus)
    return model, teacher, menus, nbytes


def blocks(n=6, seed=0):
    return torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def cfg(**kw):
    base = dict(compression_ratio=0.7, max_steps=8, seq_len=SEQ, batch_size=2, lr=0.1,
                partial_save_interval=3, t_start=1.0, t_end=0.2, size_weight=10.0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_config_roundtrip_and_validation():
    c = cfg(target_bits=4.5, compression_ratio=None, dtype="bfloat16")
    assert TrainConfig.from_json(c.to_json()) == c
    assert TrainConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="exactly one"):
        cfg(target_bits=4.5)
    with pytest.raises(ValueError, match="unknown TrainConfig keys"):
        TrainConfig.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="version"):
        TrainConfig.from_dict({**c.to_dict(), "version": 99})
    with pytest.raises(ValueError, match="max_steps"):
        cfg(max_steps=0)
    with pytest.raises(ValueError, match="dtype"):
        cfg(dtype="int8")


def test_temperature_schedule_is_geometric():
    c = cfg(max_steps=5, t_start=1.0, t_end=0.0625)
    ts = [temperature_at(s, c) for s in range(5)]
    assert ts == pytest.approx([1.0, 0.5, 0.25, 0.125, 0.0625])


def test_batch_indices_deterministic_epochs():
    a = torch.cat([batch_indices(s, 6, 2, seed=1) for s in range(3)])
    assert sorted(a.tolist()) == list(range(6))  # one epoch = a permutation
    assert torch.equal(batch_indices(4, 6, 2, 1), batch_indices(4, 6, 2, 1))
    assert not torch.equal(torch.cat([batch_indices(s, 6, 2, 2) for s in range(3)]), a)


def test_distill_losses_zero_kl_for_same_logits():
    lg = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    ce, kl = distill_losses(lg, lg, ids)
    assert kl.item() == pytest.approx(0.0, abs=1e-6)
    want = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert ce.item() == pytest.approx(want.item())


def test_training_moves_gates_only(tmp_path):
    student, teacher, _, _ = gated_llama()
    frozen = {n: p.detach().clone() for n, p in student.named_parameters() if "logits" not in n}
    res = train_gates(student, teacher, blocks(), cfg(), tmp_path, progress=False)
    assert res.finished and res.step == 8 and len(res.history) == 8
    assert set(res.history[0]) >= {"loss", "ce", "kl", "penalty", "size_ratio", "temperature"}
    assert res.history[-1]["temperature"] == pytest.approx(0.2)
    assert all(torch.equal(p, frozen[n]) for n, p in student.named_parameters() if n in frozen)
    assert len(res.gates) == 9
    assert (tmp_path / JOURNAL_NAME).exists()
    # Rerunning a finished run returns its result without training.
    again = train_gates(student, teacher, blocks(), cfg(), tmp_path, progress=False)
    assert all(torch.equal(again.gates[n], res.gates[n]) for n in res.gates)


def test_teacher_callable_and_size_pull():
    """With a big size weight and no KL, the expected size is pulled to the budget."""
    student, teacher, _, _ = gated_llama()
    with torch.no_grad():
        for m in mixed_weights(student).values():
            m.logits.zero_()
    c = cfg(max_steps=12, kl_weight=0.0, size_weight=1e4, size_tolerance=0.0, lr=0.3,
            gate_init="uniform", t_end=1.0, compression_ratio=0.6)
    res = train_gates(student, lambda ids: teacher(input_ids=ids).logits, blocks(), c,
                      progress=False)
    first, last = res.history[0]["size_ratio"], res.history[-1]["size_ratio"]
    assert abs(last - 1) < abs(first - 1) / 3


class _Crash(Exception):
    pass


def test_resume_reproduces_uninterrupted_run(tmp_path):
    student, teacher, menus, nbytes = gated_llama()
    full = train_gates(student, teacher, blocks(), cfg(), tmp_path / "a", progress=False)

    # Crash after step 7 (journal written at step 6), then rerun in the same folder.
    def crash(step, _):
        if step == 7:
            raise _Crash

    student, teacher, _, _ = gated_llama()
    with pytest.raises(_Crash):
        train_gates(student, teacher, blocks(), cfg(), tmp_path / "b", progress=False,
                    callback=crash)
    student, teacher, _, _ = gated_llama()
    resumed = train_gates(student, teacher, blocks(), cfg(), tmp_path / "b", progress=False)
    # A graceful stop (stop_after) then resume, too.
    student, teacher, _, _ = gated_llama()
    part = train_gates(student, teacher, blocks(), cfg(), tmp_path / "c", progress=False,
                       stop_after=4)
    assert not part.finished and part.step == 4
    student, teacher, _, _ = gated_llama()
    stopped = train_gates(student, teacher, blocks(), cfg(), tmp_path / "c", progress=False)

    for other in (resumed, stopped):
        assert other.step == full.step and other.finished
        for n in full.gates:
            assert torch.equal(other.gates[n], full.gates[n]), n
        assert [h["loss"] for h in other.history] == [h["loss"] for h in full.history]
    budget = full.budget_bytes
    assert bake(resumed.gates, menus, nbytes, budget) == bake(full.gates, menus, nbytes, budget)


def test_ctrl_c_between_journal_saves_keeps_the_finished_steps(tmp_path, capsys):
    """Ctrl-C after step 5 with the journal last written at step 3 (interval 3): the journal
    is written with step 5 on the way out (it used to keep step 3: with the CLI's default
    interval of 10, a Ctrl-C lost up to 9 finished steps), and the rerun ends with the gates
    of an uninterrupted run."""
    student, teacher, _, _ = gated_llama()
    full = train_gates(student, teacher, blocks(), cfg(), tmp_path / "a", progress=False)

    def ctrl_c(step, _):
        if step == 5:
            raise KeyboardInterrupt

    student, teacher, _, _ = gated_llama()
    with pytest.raises(KeyboardInterrupt):
        train_gates(student, teacher, blocks(), cfg(), tmp_path / "b", progress=False,
                    callback=ctrl_c)
    assert "holds step 5 of 8" in capsys.readouterr().err
    st = torch.load(tmp_path / "b" / JOURNAL_NAME, weights_only=True)
    assert st["step"] == 5 and len(st["history"]) == 5
    seen = []
    student, teacher, _, _ = gated_llama()
    resumed = train_gates(student, teacher, blocks(), cfg(), tmp_path / "b", progress=False,
                          callback=lambda step, _: seen.append(step))
    assert seen == [6, 7, 8]
    student, teacher, _, _ = gated_llama()
    with pytest.raises(KeyboardInterrupt):   # the rerun says where it resumes
        train_gates(student, teacher, blocks(), cfg(max_steps=9), tmp_path / "c",
                    progress=True, callback=ctrl_c)
    capsys.readouterr()
    student, teacher, _, _ = gated_llama()
    train_gates(student, teacher, blocks(), cfg(max_steps=9), tmp_path / "c", progress=True,
                stop_after=6)
    assert "resuming from" in capsys.readouterr().err
    for n in full.gates:
        assert torch.equal(resumed.gates[n], full.gates[n]), n
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]


def test_corrupt_journal_raises_and_is_kept(tmp_path):
    student, teacher, _, _ = gated_llama()
    (tmp_path / JOURNAL_NAME).write_bytes(b"not a torch file")
    with pytest.raises(CorruptJournalError, match="delete it"):
        train_gates(student, teacher, blocks(), cfg(), tmp_path, progress=False)
    assert (tmp_path / JOURNAL_NAME).read_bytes() == b"not a torch file"
    torch.save({"step": 3}, tmp_path / JOURNAL_NAME)
    with pytest.raises(CorruptJournalError, match="not a complete training journal"):
        train_gates(student, teacher, blocks(), cfg(), tmp_path, progress=False)


def test_resume_with_other_settings_refused(tmp_path):
    student, teacher, _, _ = gated_llama()
    train_gates(student, teacher, blocks(), cfg(), tmp_path, progress=False, stop_after=3)
    student, teacher, _, _ = gated_llama()
    with pytest.raises(ValueError, match="different run.*lr"):
        train_gates(student, teacher, blocks(), cfg(lr=0.01), tmp_path, progress=False)


def test_bad_inputs():
    student, teacher, _, _ = gated_llama()
    with pytest.raises(ValueError, match="seq_len"):
        train_gates(student, teacher, torch.zeros(2, 5, dtype=torch.long), cfg(), progress=False)
    with pytest.raises(ValueError, match="reachable range"):
        train_gates(student, teacher, blocks(), cfg(compression_ratio=0.2), progress=False)


def test_grad_sync_hook_and_progress_bar(tmp_path):
    """grad_sync sees every gate's grad before the step; zeroing them freezes the gates."""
    student, teacher, _, _ = gated_llama()
    seen = []

    def sync(params):
        seen.append(len(params))
        for p in params:
            p.grad.zero_()

    c = cfg(max_steps=2, gate_init="uniform")
    res = train_gates(student, teacher, blocks(), c, progress=True, grad_sync=sync)
    assert seen == [9, 9]
    assert all(torch.equal(v, torch.zeros(3)) for v in res.gates.values())
    with pytest.raises(ValueError, match="divisible by world_size"):
        train_gates(student, teacher, blocks(), c, progress=False, rank=0, world_size=3)


def test_training_progress_in_a_log_is_one_line_a_step(tmp_path):
    """stderr a file (a log): one line a step, with that step's metrics (the postfix used to
    be set after the step's redraw, a second line every step)."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r})\n"
            "from voodoo.progress import tame_tqdm; assert tame_tqdm(mininterval=0.0)\n"
            "from test_train import blocks, cfg, gated_llama\n"
            "from voodoo.train import train_gates\n"
            "s, t, _, _ = gated_llama()\n"
            "train_gates(s, t, blocks(), cfg(), None, progress=True)\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("gates:")]
    counts = [ln.split("|")[2].split()[0] for ln in lines]
    # the start, each step once with its metrics, and the closing line
    assert counts == [f"{i}/8" for i in range(9)] + ["8/8"], "\n".join(lines)
    assert all("loss=" in ln for ln in lines[1:]), "\n".join(lines)
