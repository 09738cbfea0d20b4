"""grpo.py's `grpo_loss` against TRL 1.16's own `GRPOTrainer._compute_loss`, on identical tensors.

Not a test (CI does not install TRL): a check to rerun when either side changes. In a separate
virtualenv (TRL pulls accelerate, datasets, ...):

    python -m venv /tmp/trl && . /tmp/trl/bin/activate && pip install torch==2.13.0 trl==1.16.0
    python tools/trl_loss_parity.py

It calls TRL's real loss method on a bare trainer object with the attributes that method reads
set by hand (single process, no vLLM, token-level ratio, no entropy or off-policy masks), for
every loss type x beta in {0, 0.04} x KL bias correction on/off x clip ranges x on/off-policy,
20 random batches each, in float64 and float32, and prints the largest loss and gradient
differences. Results: docs/benchmarks.md. Reaching into TRL's internals is deliberate here: the
point is to compare with the exact code a TRL user runs.
"""
import itertools
import os
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import trl  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from grpo import grpo_loss  # noqa: E402

assert trl.__version__ == "1.16.0", trl.__version__
B, T, MAXLEN = 6, 7, 7  # MAXLEN = max_completion_length (= T, as TRL pads completions to <= that)


class Acc:  # single-process accelerator stub
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def make_trainer(loss_type, beta, bias_kl, eps_lo, eps_hi, per_token_logps):
    args = GRPOConfig(
        output_dir="/tmp/trl-loss-parity", report_to=[], use_cpu=True, per_device_train_batch_size=B,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=2,
        max_completion_length=MAXLEN, beta=beta, loss_type=loss_type, epsilon=eps_lo, epsilon_high=eps_hi,
        use_bias_correction_kl=bias_kl, importance_sampling_level="token", use_vllm=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, delta=None,
    )
    assert args.delta is None and args.steps_per_generation == 1
    tr = object.__new__(GRPOTrainer)
    tr.args = args
    tr.loss_type, tr.beta = loss_type, beta
    tr.epsilon_low, tr.epsilon_high = eps_lo, eps_hi
    tr.importance_sampling_level = "token"
    tr.top_entropy_quantile = 1.0
    tr.off_policy_mask_threshold = None
    tr.use_vllm = False
    tr.vllm_importance_sampling_correction = False
    tr.aux_loss_enabled = False
    tr._entropy_bonus_enabled = False
    tr.max_completion_length = MAXLEN
    tr.current_gradient_accumulation_steps = 1
    tr.accelerator = Acc()
    tr.model = SimpleNamespace(training=True)
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr._get_per_token_logps_and_entropies = (
        lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps).detach(), None))
    return tr


def run_case(seed, dtype, off_policy, loss_type, beta, bias_kl, eps_lo, eps_hi):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).int()  # int, as in TRL
    base = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)
    ref = (base.double() + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype)
    adv = torch.randn(B, generator=g, dtype=torch.float64).to(dtype)
    noise = (0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype)

    # --- TRL
    lp_trl = base.clone().requires_grad_(True)
    old = (lp_trl.detach() + noise) if off_policy else None  # None -> TRL uses per_token_logps.detach()
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": completion_mask,
        "advantages": adv, "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum(),  # = gather(loss_mask.sum()).sum(), grpo_trainer.py:2498
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    tr = make_trainer(loss_type, beta, bias_kl, eps_lo, eps_hi, lp_trl)
    loss_trl = tr._compute_loss(tr.model, inputs)
    loss_trl.backward()

    # --- ours
    lp = base.clone().requires_grad_(True)
    old_ours = lp.detach() if old is None else old
    loss, stats = grpo_loss(lp, old_ours, ref, adv, completion_mask, beta=beta, epsilon_low=eps_lo,
                            epsilon_high=eps_hi, loss_type=loss_type, max_new_tokens=MAXLEN,
                            normalizer=None, kl_bias_correction=bias_kl)
    loss.backward()

    m = tr._metrics["train"]
    d_clip = abs(m["clip_ratio/region_mean"][-1] - float(stats["clipped_tokens"] / stats["tokens"]))
    return (abs(loss_trl.item() - loss.item()), (lp_trl.grad - lp.grad).abs().max().item(),
            float(stats["clipped_tokens"]), d_clip, loss.item())


if __name__ == "__main__":
    cases = list(itertools.product(["dapo", "grpo", "dr_grpo"], [0.0, 0.04], [True, False],
                                   [(0.2, 0.2), (0.2, 0.28)], [False, True]))
    worst = 0.0
    for dtype in (torch.float64, torch.float32):
        print(f"== {dtype}  (max over seeds 0..19; clip = clipped tokens summed over seeds)")
        print(f"{'loss_type':8} {'beta':>5} {'biasKL':>6} {'eps':>9} {'policy':>6} {'max|dL|':>9} {'max|dG|':>9} "
              f"{'clip':>5} {'|dClipMetric|':>13}")
        for lt, beta, bias, (lo, hi), offp in cases:
            rs = [run_case(s, dtype, offp, lt, beta, bias, lo, hi) for s in range(20)]
            dl, dg = max(r[0] for r in rs), max(r[1] for r in rs)
            clip, dc = sum(r[2] for r in rs), max(r[3] for r in rs)
            if dtype == torch.float64:
                worst = max(worst, dl, dg)
            print(f"{lt:8} {beta:5.2f} {str(bias):>6} {lo:.2f}/{hi:.2f} {'off' if offp else 'on':>6} "
                  f"{dl:9.2e} {dg:9.2e} {int(clip):5d} {dc:13.1e}")
    print(f"worst float64 diff: {worst:.2e}  ->", "PASS" if worst < 1e-12 else "FAIL")
