"""The training recipes' parts on their own: each loss against its formula on small
distributions, mixes, the schedule's shape, and which weights Muon takes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mm_assets.domain.model.losses import LOSSES, parse_loss, position_losses
from mm_assets.domain.model.optimization import lr_factor, optimizers

P = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
Q = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]])


def _loss(name: str) -> list[float]:
    return position_losses(P.log(), Q.log(), {name: 1.0}).tolist()


def _per_row(term) -> list[float]:
    rows = zip(P.tolist(), Q.tolist(), strict=True)
    return [sum(term(p, q) for p, q in zip(a, b, strict=True)) for a, b in rows]


def test_each_loss_is_its_formula() -> None:
    kl = _per_row(lambda p, q: p * math.log(p / q))
    rkl = _per_row(lambda p, q: q * math.log(q / p))
    tv = _per_row(lambda p, q: 0.5 * abs(p - q))
    accept = _per_row(min)
    assert _loss("kl") == pytest.approx(kl, rel=1e-5)
    assert _loss("rkl") == pytest.approx(rkl, rel=1e-5)
    assert _loss("tv") == pytest.approx(tv, rel=1e-5)
    assert [1 - t for t in tv] == pytest.approx(accept)  # D_LK = 1 - acceptance
    assert _loss("nla") == pytest.approx([-math.log(a) for a in accept], rel=1e-5)
    assert _loss("ce") == pytest.approx([-math.log(0.5), -math.log(0.2)], rel=1e-5)
    m = (P + Q) / 2
    jsd = 0.5 * F.kl_div(m.log(), P, reduction="none").sum(-1)
    jsd += 0.5 * F.kl_div(m.log(), Q, reduction="none").sum(-1)
    assert _loss("jsd") == pytest.approx(jsd.tolist(), rel=1e-5)


def test_every_loss_is_zero_when_the_draft_is_the_teacher_but_ce() -> None:
    for name in LOSSES:
        same = position_losses(P.log(), P.log(), {name: 1.0})
        if name == "ce":
            assert (same > 0).all()  # the teacher is not one-hot
        else:
            assert same.abs().max() < 1e-6, name


def test_a_mix_is_the_weighted_sum_and_bad_recipes_are_refused() -> None:
    assert parse_loss("kl") == {"kl": 1.0}
    assert parse_loss("kl=0.5, tv=2") == {"kl": 0.5, "tv": 2.0}
    mixed = position_losses(P.log(), Q.log(), parse_loss("kl=0.5,tv=2"))
    expected = [0.5 * k + 2 * t for k, t in zip(_loss("kl"), _loss("tv"), strict=True)]
    assert mixed.tolist() == pytest.approx(expected)
    for bad, says in [("lk", "use one of"), ("kl=x", "not a number"), ("kl=-1", "≥ 0"),
                      ("kl=0", "above 0"), ("kl,kl", "each name once")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_loss(bad)


def test_the_schedule_warms_up_then_decays_to_its_floor() -> None:
    total = 100
    cosine = [lr_factor(s, total, "cosine", 0.1, 0.1) for s in range(total)]
    assert cosine[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert cosine[10] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(cosine[10:]))
    linear = [lr_factor(s, total, "linear", 0.0, 0.0) for s in range(total)]
    assert linear[0] == 1.0 and linear[50] == pytest.approx(0.5)
    assert {lr_factor(s, total, "constant", 0.0, 0.5) for s in range(total)} == {1.0}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4, bias=False))
    model.add_module("norm", nn.LayerNorm(4))
    model.add_module("lm_head", nn.Linear(4, 3, bias=False))
    both = optimizers(model, "muon", 1e-3, 10, ("cosine", 0.2, 0.0))
    kinds = {
        type(o).__name__: sum(len(g["params"]) for g in o.param_groups) for o in both.optimizers
    }
    assert kinds == {"Muon": 1, "AdamW": 3}  # fc; the norm's two vectors and the head
    assert both.lr == pytest.approx(0.5e-3)  # the first warmup step
    loss = model(torch.randn(2, 4)).square().sum()
    loss.backward()
    before = model.fc.weight.detach().clone()
    both.step()
    assert not torch.equal(before, model.fc.weight) and both.lr == pytest.approx(1e-3)
    restored = optimizers(model, "muon", 1e-3, 10, ("cosine", 0.2, 0.0))
    restored.load_state_dict(both.state_dict())
    assert restored.lr == both.lr
    plain = optimizers(model, "adamw", 1e-3, 10, ("constant", 0.0, 0.0))
    assert [type(o).__name__ for o in plain.optimizers] == ["AdamW"]
