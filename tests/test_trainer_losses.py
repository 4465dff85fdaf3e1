"""The trainer's loss against a plain per-token reference, and its behaviour at the clip/TIS/band edges."""

import math

import pytest
import torch

from sparrow.trainer.advantages import grpo_advantages
from sparrow.trainer.config import LossConfig
from sparrow.trainer.losses import k3_kl, policy_loss


def reference_loss(logp, old, roll, adv, mask, cfg: LossConfig, n, ref=None):
    """Token by token, straight from the formulas in docs/trainer.md."""
    total = 0.0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        r = math.exp(max(min(float(logp[t]) - float(old[t]), 20), -20))
        a = float(adv[t])
        loss = max(-a * r, -a * min(max(r, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high))
        if cfg.dual_clip is not None and a < 0:
            loss = min(loss, -a * cfg.dual_clip)
        w = math.exp(max(min(float(old[t]) - float(roll[t]), 20), -20))
        weight = min(w, cfg.tis_cap) if cfg.tis_cap is not None else 1.0
        if cfg.mask_band is not None and not (cfg.mask_band[0] <= w <= cfg.mask_band[1]):
            weight = 0.0
        total += loss * weight
        if cfg.kl_coef > 0:
            d = max(min(float(ref[t]) - float(logp[t]), 20), -20)
            total += cfg.kl_coef * max(min(math.exp(d) - d - 1, 10), -10)
    return total / n


CONFIGS = [
    LossConfig(),
    LossConfig(tis_cap=None, dual_clip=None),
    LossConfig(mask_band=(0.5, 2.0), tis_cap=2.0),
    LossConfig(kl_coef=0.1, clip_eps_high=0.2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "no-tis-no-dual", "band", "kl"])
def test_policy_loss_matches_reference_value_and_gradient(cfg):
    g = torch.Generator().manual_seed(0)
    n = 400
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    logp = (old + torch.randn(n, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    roll = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    ref = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    out = policy_loss(logp, old, roll, adv, mask, cfg, normalizer=517.0, ref_logp=ref)
    expected = reference_loss(logp.detach(), old, roll, adv, mask, cfg, 517.0, ref)
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    out.loss.backward()
    eps = 1e-6
    for t in torch.randperm(n, generator=g)[:40].tolist():  # central differences of the reference
        hi, lo = logp.detach().clone(), logp.detach().clone()
        hi[t] += eps
        lo[t] -= eps
        fd = (reference_loss(hi, old, roll, adv, mask, cfg, 517.0, ref) - reference_loss(lo, old, roll, adv, mask, cfg, 517.0, ref)) / (2 * eps)
        assert float(logp.grad[t]) == pytest.approx(fd, abs=1e-7)
    assert float(out.sums["tokens"]) == int(mask.sum())


def _one(logp, old, roll, adv, cfg):
    lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, torch.tensor([old], dtype=torch.float64), torch.tensor([roll], dtype=torch.float64),
                      torch.tensor([adv], dtype=torch.float64), torch.tensor([True]), cfg, 1.0)
    out.loss.backward()
    return float(out.loss.detach()), float(lp.grad[0]), {k: float(v) for k, v in out.sums.items()}


def test_ppo_clip_edges():
    cfg = LossConfig(tis_cap=None)
    up, down = math.log(1.5), math.log(0.5)
    loss, grad, s = _one(up, 0.0, 0.0, 1.0, cfg)  # A > 0, ratio above 1 + ε_high: clipped, no gradient
    assert loss == pytest.approx(-1.28) and grad == 0.0 and s["clipped"] == 1
    loss, grad, s = _one(down, 0.0, 0.0, 1.0, cfg)  # A > 0, ratio below 1 − ε_low: unclipped
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5) and s["clipped"] == 0
    loss, grad, s = _one(down, 0.0, 0.0, -1.0, cfg)  # A < 0, ratio below 1 − ε_low: clipped
    assert loss == pytest.approx(0.8) and grad == 0.0 and s["clipped"] == 1
    loss, grad, s = _one(math.log(2.0), 0.0, 0.0, -1.0, cfg)  # A < 0, 1 + ε < ratio < c: unclipped
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and s["dual_clipped"] == 0
    loss, grad, s = _one(math.log(5.0), 0.0, 0.0, -1.0, cfg)  # A < 0, ratio > c = 3: dual clip
    assert loss == pytest.approx(3.0) and grad == 0.0 and s["dual_clipped"] == 1
    loss, _, s = _one(math.log(5.0), 0.0, 0.0, -1.0, LossConfig(tis_cap=None, dual_clip=None))
    assert loss == pytest.approx(5.0) and s["dual_clipped"] == 0


def test_tis_cap_edges():
    cfg = LossConfig(tis_cap=3.0)
    # on-policy (logp = old): L = −A·w·... with w = p_dense / q_rollout
    loss, grad, s = _one(0.0, 0.0, -math.log(2.0), 1.0, cfg)  # w = 2 < C
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0) and s["tis_capped"] == 0
    loss, _, s = _one(0.0, 0.0, 0.0, 1.0, LossConfig(tis_cap=1.0))  # w = C exactly: weight C, not counted as capped
    assert loss == -1.0 and s["tis_capped"] == 0
    loss, grad, s = _one(0.0, 0.0, -math.log(10.0), 1.0, cfg)  # w = 10 > C: capped at C
    assert loss == pytest.approx(-3.0) and grad == pytest.approx(-3.0) and s["tis_capped"] == 1
    loss, _, s = _one(0.0, 0.0, -math.log(10.0), 1.0, LossConfig(tis_cap=None))  # TIS off
    assert loss == pytest.approx(-1.0) and s["tis_capped"] == 0
    loss, _, _ = _one(0.0, 0.0, math.log(4.0), 1.0, cfg)  # w = 1/4: no lower truncation
    assert loss == pytest.approx(-0.25)


def test_mask_band_edges():
    cfg = LossConfig(tis_cap=None, mask_band=(0.5, 2.0))
    for w, kept in [(0.5, True), (2.0, True), (0.49, False), (2.01, False), (1.0, True)]:
        loss, grad, s = _one(0.0, 0.0, -math.log(w), 1.0, cfg)
        if kept:
            assert loss == pytest.approx(-1.0) and s["band_masked"] == 0
        else:
            assert loss == 0.0 and grad == 0.0 and s["band_masked"] == 1


def test_masked_tokens_still_count_in_the_token_mean():
    cfg = LossConfig(tis_cap=None, mask_band=(0.5, 2.0))
    lp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    roll = torch.tensor([0.0, 0.0, -5.0, 5.0], dtype=torch.float64)  # last two outside the band
    out = policy_loss(lp, lp.detach(), roll, torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool), cfg, 4.0)
    assert float(out.loss.detach()) == pytest.approx(-0.5)  # two kept tokens / four loss tokens


def test_k3_kl():
    x = torch.tensor([-1.0, -2.0, -3.0])
    assert torch.equal(k3_kl(x, x), torch.zeros(3))
    d = torch.tensor([0.5])
    assert float(k3_kl(torch.zeros(1), d)) == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert float(k3_kl(torch.zeros(1), torch.tensor([30.0]))) == 10.0  # δ clamped to 20, result to 10
    assert float(k3_kl(torch.zeros(1), torch.tensor([-30.0]))) == 10.0  # e^−20 + 20 − 1 = 19, clamped to 10


def test_policy_loss_rejects_bad_inputs():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(x, x, x, x, torch.ones(2, dtype=torch.bool), LossConfig(), 0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, x, x, torch.ones(2, dtype=torch.bool), LossConfig(kl_coef=0.1), 1.0)


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    groups = ["a", "a", "a", "a", "b", "c", "c"]
    adv = grpo_advantages(rewards, groups)
    a = rewards[:4]
    assert torch.allclose(adv[:4], ((a - a.mean()) / (a.std() + 1e-6)).double())
    assert adv[4] == 0.0  # a group of one has no baseline
    assert torch.equal(adv[5:], torch.zeros(2, dtype=torch.float64))  # equal rewards: zero, not NaN
    centred = grpo_advantages(rewards, groups, std_norm=False)
    assert torch.allclose(centred[:4], (a - a.mean()).double())
    with pytest.raises(ValueError, match="not finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), ["a", "a"])
