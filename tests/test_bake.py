"""voodoo.bake: argmax, --tensor_upgrades guardrails, repair to the budget."""

import json
import math

import pytest
import torch

from voodoo.bake import PLAUSIBLE, bake, parse_tensor_upgrades
from voodoo.quants import DEFAULT_NON_ATTENTION_MENU, build_menu, tensor_nbytes


def synthetic(n_layers=6, seed=0):
    """Tensors of a small model-like shape set, real menus and sizes, random logits."""
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for i in range(n_layers):
        shapes[f"blk.{i}.attn_q.weight"] = (256, 256)
        shapes[f"blk.{i}.attn_k.weight"] = (64, 256)
        shapes[f"blk.{i}.ffn_up.weight"] = (768, 256)
        shapes[f"blk.{i}.ffn_down.weight"] = (256, 768)
    shapes["token_embd.weight"] = (2048, 256)
    menus, nbytes, logits = {}, {}, {}
    for n, (r, c) in shapes.items():
        menus[n] = [q.name for q in build_menu(DEFAULT_NON_ATTENTION_MENU, c)]
        nbytes[n] = [tensor_nbytes(t, r, c) for t in menus[n]]
        logits[n] = torch.randn(len(menus[n]), generator=g) * 2
    return logits, menus, nbytes


def total_of(a):
    return sum(t["bytes"] for t in a["tensors"].values())


def test_argmax_when_it_fits():
    logits, menus, nbytes = synthetic()
    arg = {n: int(torch.argmax(z)) for n, z in logits.items()}
    b = sum(nbytes[n][k] for n, k in arg.items())
    a = bake(logits, menus, nbytes, b)
    assert all(a["tensors"][n]["type"] == menus[n][k] for n, k in arg.items())
    assert a["total_bytes"] == b == total_of(a) and a["budget_bytes"] == b
    t = a["tensors"]["blk.0.attn_q.weight"]
    assert set(t) == {"type", "bytes", "menu", "probs"}
    assert sum(t["probs"]) == pytest.approx(1.0)
    json.dumps(a)


@pytest.mark.parametrize("frac", [0.2, 0.35, 0.5, 0.65, 0.8, 0.95])
def test_repair_lands_within_tolerance(frac):
    logits, menus, nbytes = synthetic()
    lo = sum(min(b) for b in nbytes.values())
    hi = sum(max(b) for b in nbytes.values())
    budget = int(lo + frac * (hi - lo))
    a = bake(logits, menus, nbytes, budget, tolerance=0.005)
    assert a["total_bytes"] == total_of(a)
    assert budget * 0.995 <= a["total_bytes"] <= budget * 1.005
    assert bake(logits, menus, nbytes, budget) == a  # deterministic


def test_repair_follows_the_gates():
    """Over budget, the tensor whose gate is indifferent gives up bits first."""
    menus = {"a": ["Q8_0", "Q4_0"], "b": ["Q8_0", "Q4_0"]}
    nbytes = {"a": [1000, 500], "b": [1000, 500]}
    logits = {"a": torch.tensor([5.0, 0.0]), "b": torch.tensor([0.1, 0.0])}
    a = bake(logits, menus, nbytes, 1500, tolerance=0.0)
    assert a["tensors"]["a"]["type"] == "Q8_0" and a["tensors"]["b"]["type"] == "Q4_0"


def test_upgrades_move_and_guard():
    logits, menus, nbytes = synthetic()
    arg = {n: int(torch.argmax(z)) for n, z in logits.items()}
    budget = sum(nbytes[n][k] for n, k in arg.items())
    # +1 on ffn_down, -2 on attn_k; a generous tolerance so no repair is needed.
    ups = json.dumps([{"pattern": r"ffn_down", "levels": 1}, {"pattern": r"attn_k", "levels": -2}])
    a = bake(logits, menus, nbytes, budget, tensor_upgrades=ups, tolerance=0.5)
    for n, k in arg.items():
        want = k
        if "ffn_down" in n:
            want = max(k - 1, 0)
        if "attn_k" in n:
            want = min(k + 2, len(menus[n]) - 1)
        assert a["tensors"][n]["type"] == menus[n][want], n
    # Tight budget: the repair takes bits elsewhere and keeps ffn_down at or above its level.
    b = bake(logits, menus, nbytes, budget, tensor_upgrades=ups, tolerance=0.005)
    assert budget * 0.995 <= b["total_bytes"] <= budget * 1.005
    for n, k in arg.items():
        if "ffn_down" in n:
            assert menus[n].index(b["tensors"][n]["type"]) <= max(k - 1, 0), n
    # Clamped at the menu's top.
    c = bake(logits, menus, nbytes, 10 ** 9, tensor_upgrades=[{"pattern": "", "levels": 99}],
             tolerance=1.0)
    assert all(t["type"] == t["menu"][0] for t in c["tensors"].values())


def test_upgrades_say_what_they_moved(capsys):
    """A bake with guardrails says, per rule, how many tensors it moved (a new user saw the
    same byte total with and without them and could not tell that 62 tensors had moved)."""
    logits, menus, nbytes = synthetic()
    arg = {n: int(torch.argmax(z)) for n, z in logits.items()}
    budget = sum(nbytes[n][k] for n, k in arg.items())
    top = sum(arg[n] == 0 for n in arg if "ffn_down" in n)
    bake(logits, menus, nbytes, budget, tolerance=0.5,
         tensor_upgrades=[{"pattern": "ffn_down", "levels": 1}])
    err = capsys.readouterr().err
    moved = 6 - top
    assert f"guardrails (--tensor_upgrades): 'ffn_down' +1: {moved} of 6 tensors moved" in err
    assert (f"({top} at the end of their menu)" in err) == (top > 0), err
    bake(logits, menus, nbytes, budget, tolerance=0.5)
    assert "guardrails" not in capsys.readouterr().err


def test_guardrails_hold_under_the_budget_and_give_way_over_it_with_a_warning():
    """A downgrade rule whose tensor cannot be paid back inside the window stays down (the
    repair dropped it silently to spend the bytes it saved); an upgrade rule that cannot fit
    the budget gives way, and a warning names the tensor and the rule."""
    menus = {"big": ["A", "B"], "small": ["A", "B", "C", "D"]}
    nbytes = {"big": [1000, 500], "small": [100, 90, 80, 70]}
    with pytest.warns(UserWarning, match="guardrails of 1 tensor"):
        a = bake({"big": [0.0, 5.0], "small": [5.0, 0.0, 0.0, 0.0]}, menus, nbytes, 600,
                 tensor_upgrades='[{"pattern": "small", "levels": -3}]')
    assert {n: t["type"] for n, t in a["tensors"].items()} == {"big": "B", "small": "D"}
    with pytest.warns(UserWarning, match=r"could not be kept .* small D \(the rule asks for "
                                         r"at least A\)"):
        b = bake({"big": [0.0, 5.0], "small": [0.0, 0.0, 0.0, 5.0]}, menus, nbytes, 570,
                 tolerance=0.0, tensor_upgrades='[{"pattern": "small", "levels": 3}]')
    assert b["total_bytes"] == 570
    # over the budget at the argmax, and no landing inside the window keeps the downgrade
    # rule: it holds, under the budget (a downgrade never needs to give way to save bytes)
    with pytest.warns(UserWarning, match="guardrails of 1 tensor"):
        c = bake({"big": [5.0, 0.0], "small": [5.0, 0.0, 0.0, 0.0]}, menus, nbytes, 600,
                 tensor_upgrades='[{"pattern": "small", "levels": -3}]')
    assert {n: t["type"] for n, t in c["tensors"].items()} == {"big": "B", "small": "D"}
    # a downgrade rule that caps the whole file under the window is named as the reason
    with pytest.warns(UserWarning, match=r"cap the file at 800 bytes, every tensor at the "
                                         r"largest type they allow"):
        d = bake({"big": [5.0, 0.0], "small": [5.0, 0.0, 0.0, 0.0]}, menus,
                 {"big": [100, 50], "small": [1000, 900, 800, 700]}, 2000,
                 tensor_upgrades='[{"pattern": "small", "levels": -3}]')
    assert d["total_bytes"] == 800


def test_the_under_budget_warning_counts_only_the_guardrails_kept():
    """`[{"pattern": ".", "levels": 100}]` on a model whose largest tensor cannot take its
    rule: one warning said the guardrails of every matched tensor "are kept", the next that one
    could not be (a new user's report). The first counts only those kept."""
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = bake({"big": [0.0, 5.0], "small": [0.0, 5.0]},
                 {"big": ["A", "B"], "small": ["A", "B"]},
                 {"big": [1000, 500], "small": [100, 50]}, 700,
                 tensor_upgrades='[{"pattern": ".", "levels": 9}]')
    assert {n: t["type"] for n, t in a["tensors"].items()} == {"big": "B", "small": "A"}
    msgs = [str(x.message) for x in w]
    assert any("guardrails of 1 tensor(s) are kept" in m for m in msgs), msgs
    assert any("could not be kept" in m and "for 1 tensor(s): big B" in m for m in msgs), msgs


def test_the_last_rule_that_matches_a_tensor_decides():
    """Overlapping --tensor_upgrades rules: the last rule matching a tensor decides, counted from
    its argmax, and leaves one guardrail (up then down on one tensor left both before, a false
    "could not be kept" warning; applied one after the other, ``attn`` +1 then ``attn_v`` -1
    ended attn_v one rung *below* its argmax where the argmax was its menu's top, and at it
    elsewhere)."""
    import warnings
    menus = {"a": list("ABCD"), "b": list("ABCD")}
    nbytes = {"a": [100, 80, 60, 40], "b": [100, 80, 60, 40]}
    logits = {"a": [0, 0, 5, 0], "b": [0, 0, 5, 0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = bake(logits, menus, nbytes, 140,
                 tensor_upgrades='[{"pattern": "a", "levels": 2}, {"pattern": "a", "levels": -1}]')
    # a: argmax C, one down -> D, held there; the bytes left go to b (upgrades only)
    assert r["tensors"]["a"]["type"] == "D" and r["tensors"]["b"]["type"] == "A"
    assert r["total_bytes"] == 140
    menus = {n: list("ABC") for n in ("attn_q", "attn_v", "ffn")}
    nbytes = {n: [100, 60, 30] for n in menus}
    for top in (0, 1):   # attn_v's argmax at its menu's top, then one rung below it
        logits = {"attn_q": [0, 5, 0], "attn_v": [5, 0, 0] if top == 0 else [0, 5, 0],
                  "ffn": [0, 5, 0]}
        r = bake(logits, menus, nbytes, 10_000, tolerance=1.0, tensor_upgrades=json.dumps(
            [{"pattern": "attn", "levels": 1}, {"pattern": "attn_v", "levels": -1}]))
        assert r["tensors"]["attn_q"]["type"] == "A"
        assert r["tensors"]["attn_v"]["type"] == "BC"[top], top


@pytest.mark.parametrize("bad, msg", [
    ("[{\"pattern\": \"ffn\", \"levels\": 1}", "not valid JSON"),
    ('{"pattern": "ffn", "levels": 1}', "must be a JSON list"),
    ('[{"pattern": "ffn[", "levels": 1}]', "bad regex"),
    ('[{"pattern": "nomatch_xyz", "levels": 1}]', "matches no tensor"),
    ('[{"pattern": "ffn", "levels": 1.5}]', "levels must be an integer"),
    ('[{"pattern": "ffn", "levels": true}]', "levels must be an integer"),
    ('[{"pattern": "ffn"}]', "exactly the keys"),
    ('[{"pattern": 3, "levels": 1}]', "pattern must be a string"),
])
def test_upgrade_errors(bad, msg):
    logits, menus, nbytes = synthetic(n_layers=1)
    with pytest.raises(ValueError, match=msg):
        bake(logits, menus, nbytes, 10 ** 6, tensor_upgrades=bad)


def test_a_folder_as_upgrades_or_assignment_is_named(tmp_path):
    from voodoo.cli import UsageError, _read_assignment
    with pytest.raises(ValueError, match="a folder; give a JSON file"):
        parse_tensor_upgrades(str(tmp_path))
    (tmp_path / "m.assignment.json").write_text("{}")
    with pytest.raises(UsageError, match=r"a folder; give the .* \(e.g. .*m.assignment.json\)"):
        _read_assignment(tmp_path)


def test_parse_upgrades_from_file(tmp_path):
    p = tmp_path / "ups.json"
    p.write_text('[{"pattern": "^blk\\\\.0\\\\.", "levels": -1}]')
    rules = parse_tensor_upgrades(str(p))
    assert rules[0][1] == -1 and rules[0][0].search("blk.0.ffn_up.weight")
    assert parse_tensor_upgrades(None) == []


def test_unreachable_and_mismatched_inputs():
    logits, menus, nbytes = synthetic(n_layers=1)
    lo = sum(min(b) for b in nbytes.values())
    with pytest.raises(ValueError, match="unreachable"):
        bake(logits, menus, nbytes, int(lo * 0.9))
    del menus["token_embd.weight"]
    with pytest.raises(ValueError, match="same tensors"):
        bake(logits, menus, nbytes, lo)


def test_repair_is_the_most_probable_assignment_in_the_window():
    """Over the window [budget*(1-tol), budget*(1+tol)], the repair takes the assignment of
    largest total gate log-probability inside it among the types each gate finds plausible
    (p >= PLAUSIBLE, or its argmax), else the most probable one under its upper end; under the
    window (from the argmax or after that), the most probable upgrades inside it, none moved
    below its rung, and where none exists it stays under, with a warning (brute force over 3^6
    assignments, random instances)."""
    import itertools
    import warnings
    g = torch.Generator().manual_seed(7)
    types = ["Q8_0", "Q5_0", "Q4_0"]
    seen = {"in the window": 0, "stays under": 0, "over": 0, "under": 0}
    for trial in range(60):
        names = [f"t{i}" for i in range(6)]
        nb = {n: sorted(torch.randint(50, 2000, (3,), generator=g).tolist(), reverse=True)
              for n in names}
        logits = {n: torch.randn(3, generator=g) * 3 for n in names}
        lo_b = sum(min(v) for v in nb.values())
        hi_b = sum(max(v) for v in nb.values())
        budget = int(lo_b + (0.1 + 0.8 * torch.rand(1, generator=g).item()) * (hi_b - lo_b))
        tol = 0.05
        lower, upper = budget * (1 - tol), budget * (1 + tol)
        lp = {n: torch.log_softmax(logits[n].double(), 0).tolist() for n in names}
        combos = list(itertools.product(range(3), repeat=6))

        def total(c):
            return sum(nb[n][k] for n, k in zip(names, c))

        def logp(c):
            return sum(lp[n][k] for n, k in zip(names, c))

        start = tuple(max(range(3), key=lambda k: (lp[n][k], -k)) for n in names)
        if lower <= total(start) <= upper:
            continue   # no repair
        seen["over" if total(start) > upper else "under"] += 1
        if total(start) > upper:
            ok = [c for c in combos if lower <= total(c) <= upper and all(
                k == s or math.exp(lp[n][k]) >= PLAUSIBLE for n, k, s in zip(names, c, start))]
            start = max(ok or [c for c in combos if total(c) <= upper], key=logp)
        want = start
        if total(start) < lower:
            ups = [c for c in combos if lower <= total(c) <= upper
                   and all(k <= s for k, s in zip(c, start))]
            want = max(ups, key=logp) if ups else start
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = bake(logits, {n: types for n in names}, nb, budget, tolerance=tol)
        got = tuple(types.index(a["tensors"][n]["type"]) for n in names)
        assert a["total_bytes"] <= upper
        if total(want) < lower:   # nothing lands: upgrades only (the greedy's), still under
            assert all(k <= s for k, s in zip(got, start)), trial
            assert a["total_bytes"] < lower, trial
            assert any("under the budget" in str(x.message) for x in w), trial
            seen["stays under"] += 1
        else:
            assert logp(got) == pytest.approx(logp(want), abs=1e-9), trial
            seen["in the window"] += 1
    assert all(seen.values()), seen   # the instances reach every case


def test_under_the_budget_no_tensor_is_demoted_to_land_in_the_window():
    """A tiny model whose big tensors move in big steps, with the argmax well under the budget
    (breaker 4's ministral3 and IQ4_XS-born llama: the repair used to promote the big tensor and
    pay with near-zero-probability types elsewhere, 6-9x the KLD of the argmax file): the argmax
    and its upgrades only, under the window with a warning where nothing else lands."""
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"]
    menus = {n: ["Q8_0", "Q5_0", "IQ3_S"] for n in names}
    nb = {"token_embd.weight": [2000, 1300, 700],
          "blk.0.attn_q.weight": [110, 70, 40], "blk.0.ffn_down.weight": [330, 210, 120]}
    logits = {"token_embd.weight": torch.tensor([0.0, 20.0, 0.0]),     # Q5_0, sure
              "blk.0.attn_q.weight": torch.tensor([20.0, 0.0, 0.0]),   # Q8_0, sure
              "blk.0.ffn_down.weight": torch.tensor([20.0, 0.0, 0.0])}
    # argmax 1300 + 110 + 330 = 1740; the window [2128.5, 2171.5] holds only token_embd at
    # Q8_0 with both others at IQ3_S (2160), i.e. two tensors at p ~ 1e-9
    with pytest.warns(UserWarning, match="under the budget"):
        a = bake(logits, menus, nb, 2150, tolerance=0.01)
    assert {n: t["type"] for n, t in a["tensors"].items()} == {
        "token_embd.weight": "Q5_0", "blk.0.attn_q.weight": "Q8_0",
        "blk.0.ffn_down.weight": "Q8_0"}
    assert a["total_bytes"] == 1740


def test_repair_keeps_a_big_tensor_the_gates_prefer():
    """The per-byte greedy would demote the big tensor first (its logit gap is small per byte)
    and land under the window; the exact repair keeps it and demotes one small tensor."""
    menus = {n: ["Q8_0", "Q4_0"] for n in ("big", "s1", "s2", "s3")}
    nbytes = {"big": [1000, 700], **{s: [100, 50] for s in ("s1", "s2", "s3")}}
    logits = {"big": torch.tensor([1.0, 0.0]),
              **{s: torch.tensor([5.0 + i, 0.0]) for i, s in enumerate(("s1", "s2", "s3"))}}
    a = bake(logits, menus, nbytes, 1200, tolerance=0.05)
    assert a["tensors"]["big"]["type"] == "Q8_0"
    assert [a["tensors"][s]["type"] for s in ("s1", "s2", "s3")] == ["Q4_0", "Q8_0", "Q8_0"]
    assert a["total_bytes"] == 1250


@pytest.mark.parametrize("frac", [0.5, 0.7, 0.9])
def test_ceiling_never_over_and_within_tolerance_under(frac):
    """``ceiling=True`` (--match_size): total in [budget - tol * ref, budget], never over,
    even when the argmax alone lands just over the budget."""
    logits, menus, nbytes = synthetic()
    full = sum(max(v) for v in nbytes.values())
    budget = int(full * frac)
    a = bake(logits, menus, nbytes, budget, ceiling=True, ceiling_ref=budget + 1000)
    assert budget - 0.005 * (budget + 1000) <= a["total_bytes"] <= budget
    arg = {n: int(torch.argmax(z)) for n, z in logits.items()}
    b = sum(nbytes[n][k] for n, k in arg.items())
    a = bake(logits, menus, nbytes, b - 1, ceiling=True)  # argmax is 1 byte over
    assert b - 1 - 0.005 * (b - 1) <= a["total_bytes"] <= b - 1


def test_fill_spends_the_slack_where_the_costs_fall_most():
    """Step 5: bytes left under the budget go to the upgrades of least summed cost (checked
    against brute force over single and paired upgrades), never over budget - margin, never
    above a downgrade guardrail, and nothing moves when no upgrade lowers the cost."""
    import itertools
    logits, menus, nbytes = synthetic(n_layers=2, seed=3)
    arg = {n: int(torch.argmax(z)) for n, z in logits.items()}
    total = sum(nbytes[n][k] for n, k in arg.items())
    g = torch.Generator().manual_seed(1)
    # costs falling with the bytes, as a prior's predicted KL does
    costs = {n: sorted((torch.rand(len(menus[n]), generator=g) * 1e-3).tolist())
             for n in menus}
    names = sorted(menus)
    slack, margin = 40_000, 1_000
    a = bake(logits, menus, nbytes, total + slack, ceiling=True, tolerance=0.5, fill_costs=costs,
             fill_margin=margin)
    assert total < a["total_bytes"] <= total + slack - margin
    got = {n: menus[n].index(a["tensors"][n]["type"]) for n in names}
    assert all(got[n] <= arg[n] for n in names)  # only upgrades
    c_got = sum(costs[n][got[n]] for n in names)
    ups = [(n, k) for n in names for k in range(arg[n])]
    for pick in itertools.chain(itertools.combinations(ups, 1), itertools.combinations(ups, 2)):
        if len({n for n, _ in pick}) < len(pick):
            continue
        c = dict(arg)
        c.update(dict(pick))
        if sum(nbytes[n][c[n]] for n in names) <= total + slack - margin:
            assert c_got <= sum(costs[n][c[n]] for n in names) + 1e-12
    # a downgrade guardrail holds its tensor down
    rule = [{"pattern": r"token_embd", "levels": -1}]
    g2 = bake(logits, menus, nbytes, total + slack, tensor_upgrades=rule, ceiling=True, tolerance=0.5,
              fill_costs=costs, fill_margin=margin)
    plain = bake(logits, menus, nbytes, total + slack, tensor_upgrades=rule, ceiling=True, tolerance=0.5)
    assert menus["token_embd.weight"].index(g2["tensors"]["token_embd.weight"]["type"]) >= \
        menus["token_embd.weight"].index(plain["tensors"]["token_embd.weight"]["type"])
    # costs that rise with bytes: no upgrade pays, the argmax stays
    flat = {n: [-c for c in costs[n]] for n in names}
    b = bake(logits, menus, nbytes, total + slack, ceiling=True, tolerance=0.5, fill_costs=flat)
    assert all(b["tensors"][n]["type"] == menus[n][arg[n]] for n in names)
    with pytest.raises(ValueError, match="fill_costs"):
        bake(logits, menus, nbytes, total + slack, ceiling=True, tolerance=0.5,
             fill_costs={n: [0.0] for n in names})


def test_over_the_budget_no_tensor_takes_an_implausible_type_to_land_in_the_window():
    """Breaker 4's ministral3 with --match_size: the argmax is over; landing inside the window
    takes types the gates give p ~ 1e-9 (both blocks down, so that token_embd keeps Q8_0 and
    the head drops two rungs). The repair takes the most probable assignment under the upper
    end instead (token_embd one rung down, a coin toss for its gate), under the window, with a
    warning."""
    menus = {"token_embd.weight": ["Q8_0", "Q5_1", "IQ4_NL"],
             "output.weight": ["Q8_0", "Q5_1", "IQ4_NL"],
             "blk.0.attn_q.weight": ["Q8_0", "Q5_0", "IQ4_NL"],
             "blk.0.ffn_down.weight": ["Q8_0", "Q5_0", "IQ4_NL"]}
    nb = {"token_embd.weight": [2000, 1400, 1000], "output.weight": [2000, 1400, 1000],
          "blk.0.attn_q.weight": [100, 60, 40], "blk.0.ffn_down.weight": [100, 60, 40]}
    logits = {"token_embd.weight": torch.tensor([0.1, 0.0, -10.0]),   # Q8_0 0.52, Q5_1 0.48
              "output.weight": torch.tensor([0.0, 0.3, -5.0]),        # Q5_1, IQ4_NL p 0.004
              "blk.0.attn_q.weight": torch.tensor([20.0, 0.0, 0.0]),
              "blk.0.ffn_down.weight": torch.tensor([20.0, 0.0, 0.0])}
    # argmax 2000 + 1400 + 200 = 3600; window [3118.5, 3181.5]: only 2000 + 1000 + 60 + 60
    # (or 100 + 40) lands in it
    with pytest.warns(UserWarning, match="under the budget"):
        a = bake(logits, menus, nb, 3150, tolerance=0.01)
    assert {n: t["type"] for n, t in a["tensors"].items()} == {
        "token_embd.weight": "Q5_1", "output.weight": "Q5_1",
        "blk.0.attn_q.weight": "Q8_0", "blk.0.ffn_down.weight": "Q8_0"}
    assert a["total_bytes"] == 3000
