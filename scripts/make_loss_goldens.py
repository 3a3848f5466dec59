"""Regenerate fixtures/golden/losses.json: every training-API loss computed in
torch (float64) from its definition, with its gradient, for
crates/temper-engine/tests/loss_goldens.rs.

The definitions are Tinker's (tinker-docs.thinkingmachines.ai/tinker/losses):
`p` the learner's logprobs of the targets, `q` the sampler's, `A` the
advantages, losses summed over tokens. Run: python scripts/make_loss_goldens.py
(needs torch; scripts/requirements-fixtures.txt pins it).
"""

import json
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "losses.json"


def loss_of(name, cfg, p, q, a, w, mask):
    if name == "cross_entropy":
        return -(w * p).sum()
    r = torch.exp(p - q)
    if name == "importance_sampling":
        return -(r * a).sum()
    if name == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return -torch.min(r * a, torch.clamp(r, lo, hi) * a).sum()
    if name == "cispo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return -(torch.clamp(r, lo, hi).detach() * p * a).sum()
    if name == "dro":
        beta = cfg["beta"]
        return -(p * a - 0.5 * beta * (p - q) ** 2).sum()
    if name == "gspo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        # The sequence log-ratio: the mean token log-ratio over the marked tokens.
        log_ratio = (p.detach() - q)[mask != 0].mean()
        # Every token carries the sequence ratio's value, its own logprob's gradient.
        ratio = torch.exp(log_ratio + p - p.detach())
        return -torch.min(ratio * a, torch.clamp(ratio, lo, hi) * a).sum()
    raise ValueError(name)


def case(name, cfg, gen, n, prompt=0, drift=0.6, adv=None):
    """A datum of `n` positions, the first `prompt` of them prompt (no advantage,
    outside the gspo mask, as tinker-cookbook's rl_loop builds them)."""
    p = -torch.rand(n, generator=gen, dtype=torch.float64) * 3.0
    q = p + (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * 2 * drift
    if adv is None:
        adv = float(torch.randn(1, generator=gen, dtype=torch.float64))
    a = torch.tensor([0.0] * prompt + [adv] * (n - prompt), dtype=torch.float64)
    w = torch.tensor([0.0] * prompt + [1.0] * (n - prompt), dtype=torch.float64)
    mask = torch.tensor([0.0] * prompt + [1.0] * (n - prompt), dtype=torch.float64)
    pv = p.clone().requires_grad_(True)
    loss = loss_of(name, cfg, pv, q, a, w, mask)
    loss.backward()
    inputs = {"logprobs": q.tolist()}
    if name == "cross_entropy":
        inputs = {"weights": w.tolist()}
    else:
        inputs["advantages"] = a.tolist()
    if name == "gspo":
        inputs["sequence_ratio_mask"] = mask.tolist()
    return {
        "loss": name,
        "config": cfg,
        "p": p.tolist(),
        "inputs": inputs,
        "want_loss": loss.item(),
        "want_grad": pv.grad.tolist(),
    }


def main():
    gen = torch.Generator().manual_seed(40)
    clip = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    configs = {
        "cross_entropy": {},
        "importance_sampling": {},
        "ppo": clip,
        "cispo": clip,
        "dro": {"beta": 0.05},
        "gspo": clip,
    }
    cases = []
    for name, cfg in configs.items():
        # Near on-policy (mostly unclipped), far off-policy (clipping bites),
        # and a datum with a prompt part.
        cases.append(case(name, cfg, gen, 6, drift=0.1))
        cases.append(case(name, cfg, gen, 9, drift=1.5))
        cases.append(case(name, cfg, gen, 8, prompt=3, drift=0.8))
    # gspo with a tight clip (the paper's 3e-4 / 4e-4 scale), which the
    # sequence ratio falls outside: with one sign of the advantage the clipped
    # term wins and the whole sequence gets no gradient.
    tight = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    for adv in (1.0, -1.0):
        cases.append(case("gspo", tight, gen, 7, prompt=2, drift=0.5, adv=adv))
    OUT.write_text(json.dumps({"cases": cases}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
