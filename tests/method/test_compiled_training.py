"""--compile-train (infra/compiled_training.py): the training step through compiled decoder layers equals the eager
one up to float rounding, compiles a bounded number of times whatever the lengths, and runs a whole run.

Compiling on CPU costs tens of seconds to minutes (gcc builds inductor's kernels), so one compiled tri-model serves
the module and the tests are in the slow tier."""
import copy
import math

import pytest
import torch
from test_pipeline import make_cfg, run_training

from config import Config
from infra import compiled_step, compiled_training
from infra.console import start_line
from infra.models import load_model
from infra.options import validate
from launch.setup import adamw
from learner import forward_backward
from packing import logprobs_fn
from tri_model import TriModel

LR = 1e-3
U = 2.0 ** -24  # float32's unit roundoff


def groups(sizes: list[tuple[int, list[int]]], seed: int = 0):
    """Groups of random tokens: [(prompt (P,), [response (R_i,) ...]) ...] for sizes [(P, [R_i ...]) ...]."""
    draw = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 250, (p,), generator=draw), [torch.randint(3, 250, (r,), generator=draw) for r in rs])
            for p, rs in sizes]


def tri_models(policy, lora: bool = False):
    """(eager, compiled) tri-models over two equal copies of `policy`, θ moved off θ_0 (so the KL term is not 0;
    with `lora`, the adapter moved off B = 0), scoring packed rows under the dense mask, the path compiled training
    takes (compiled_training.py, departure 3)."""
    policy.train()
    built = []
    for compiled in (False, True):
        model = copy.deepcopy(policy)
        scorer = logprobs_fn(model, "packed", 1.0, 1, 1, dense_mask=True)
        built.append(TriModel(model, compiled_training.compiled_scorer(scorer) if compiled else scorer,
                              use_reference=True, use_old=False, adapter_off=model.disable_adapter if lora else None))
    draw = torch.Generator().manual_seed(1)
    noise = [torch.randn(p.shape, generator=draw) * 0.02 for p in trainable(policy)]
    with torch.no_grad():
        for tri in built:
            for p, n in zip(trainable(tri.policy), noise):
                p.add_(n)
    return built


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    return tri_models(load_model(str(tiny_model_dir))[0])


def rounding_bound(model, tokens: int) -> float:
    """2·stages·γ_n: how far two float32 evaluations that differ only in the order of their sums may be apart,
    relative to the magnitude of what they compute. A sum of n terms in any order is within γ_n·Σ|terms| of the
    exact sum, γ_n = n·u/(1 - n·u) (Higham, Accuracy and Stability of Numerical Algorithms, Thm 3.1; the bound holds
    for every order), so two orders are within 2γ_n of each other; n is the longest sum in the step (hidden size,
    intermediate size, or the tokens a weight gradient sums over), and each stage (every decoder layer, the final
    norm, the LM head) adds its own. The terms' magnitude stands for the result's: it assumes no cancellation, which
    holds for the log-probs (dominated by the logsumexp) and is checked against the measured differences, which sit
    orders of magnitude below it, while a real fault (a wrong mask, a layer skipped, stale weights) moves log-probs
    by 1e-2 or more."""
    config = model.config
    n = max(config.hidden_size, config.intermediate_size, tokens)
    stages = config.num_hidden_layers + 2
    return 2 * stages * n * U / (1 - n * U)


def training_step(tri: TriModel, batch, advantages: list[float], cfg) -> tuple:
    """(logp, ref_logp, mask, loss, gradients, weights before, weights after) of one step: the tri-model's log-probs,
    learner.forward_backward (loss, backward) and an AdamW step over the trainable weights, which are put back after
    (the module's tests share the tri-models)."""
    tri.policy.zero_grad(set_to_none=True)
    logp, _, ref_logp, mask = tri(batch)
    loss, _ = forward_backward(tri, batch, advantages, cfg)
    weights = trainable(tri.policy)
    grads = [p.grad.clone() for p in weights]
    before = [p.detach().clone() for p in weights]
    adamw(weights, lr=LR, weight_decay=0.0).step()
    after = [p.detach().clone() for p in weights]
    with torch.no_grad():
        for p, b in zip(weights, before):
            p.copy_(b)
    tri.policy.zero_grad(set_to_none=True)
    return logp.detach(), ref_logp, mask, loss.detach(), grads, before, after


def assert_steps_agree(eager: TriModel, compiled: TriModel):
    """The checks of `test_compiled_training_step_equals_the_eager_one`, on packed shared-prompt rows."""
    batch = groups([(9, [5, 3, 7, 2]), (14, [6, 6, 1, 4]), (5, [8, 2, 3, 3])])
    advantages = [1.0, -0.5, 0.25, -0.75] * 3
    cfg = Config(max_new_tokens=16, max_grad_norm=0.0)
    logp_e, ref_e, mask, loss_e, grads_e, start, after_e = training_step(eager, batch, advantages, cfg)
    logp_c, ref_c, mask_c, loss_c, grads_c, _, after_c = training_step(compiled, batch, advantages, cfg)
    assert compiled_training.FAILED is None and compiled_training.compilations() > 0
    assert torch.equal(mask, mask_c)
    tokens = int(mask.sum())
    eps = rounding_bound(eager.policy, tokens)
    logp_bound = eps * float(logp_e.abs().max())
    for got, expected in ((logp_c, logp_e), (ref_c, ref_e)):
        assert (got - expected).abs().max() <= logp_bound
    x = (ref_e - logp_e)[mask]
    lipschitz = cfg.beta * float((x.abs().exp() + 1).max())  # |d/dx (e^x - x - 1)| = |e^x - 1| <= e^|x| + 1
    terms = (torch.tensor(advantages)[:, None].abs() + cfg.beta * (x.exp() - x - 1).abs().max()).sum()
    assert abs(float(loss_c - loss_e)) <= tokens * lipschitz * 2 * logp_bound + eps * float(terms)
    assert not math.isclose(float(loss_e), 0.0, abs_tol=1e-3)
    for g_c, g_e in zip(grads_c, grads_e):
        assert (g_c - g_e).abs().max() <= 2 * eps * g_e.abs().max()
    for w_c, w_e, g_c, g_e, w_0 in zip(after_c, after_e, grads_c, grads_e, start):
        moved = LR * ((g_c - g_e).abs() / (torch.minimum(g_c.abs(), g_e.abs()) + 1e-8)).clamp(max=2)
        assert ((w_c - w_e).abs() <= moved * (1 + 8 * U) + 8 * U * (w_0.abs() + LR)).all()
    assert any((a - b).abs().max() > 0 for a, b in zip(after_e, start))  # the step moved the weights


@pytest.mark.slow
def test_compiled_training_step_equals_the_eager_one(pair):
    """Claim: one training step with compiled decoder layers (the tri-model's policy and reference log-probs of
    packed shared-prompt rows, the GRPO loss, its backward, an AdamW step) equals the eager step within float32's
    rounding of reordered sums (`rounding_bound`, ε): log-probs by ε·max|logp|; the loss by its Lipschitz constant in
    the log-probs times their bound (each token's term -A·ratio is -A exactly on both paths, ratio = 1; the KL term
    moves by at most β·max|e^x - 1| per unit of x = ref - logp, both of which move), plus ε·Σ|terms| of its own sum;
    each gradient by 2ε·max|g| (forward and backward both reorder); each weight after AdamW's first step, which moves
    it by lr·g/(|g| + eps), by lr·|Δg| / (min |g| + eps), at most 2·lr, plus its own rounding."""
    assert_steps_agree(*pair)


@pytest.mark.slow
def test_compiled_lora_training_step_equals_the_eager_one(tiny_model_dir):
    """Claim: the same holds for a LoRA adapter (--use-peft): the reference is the base with the adapter switched
    off inside the compiled layers (a compilation of its own), only A and B have gradients and move."""
    pytest.importorskip("peft")
    from infra.models import with_lora
    policy = with_lora(load_model(str(tiny_model_dir))[0], r=4, alpha=8, dropout=0.0, target_modules=None, seed=0)
    assert_steps_agree(*tri_models(policy, lora=True))


@pytest.mark.slow
def test_recompiles_are_bounded_across_lengths(pair):
    """Claim: rows and row length are symbolic in the compiled layers, so micro-batches of every length reuse the
    compiled code: at most four compilations in all (the policy with gradients, the frozen reference without, each
    once more for a micro-batch of one row, which Dynamo specialises), and none at all for new lengths once each kind
    has been seen."""
    _, compiled = pair
    start = compiled_training.compilations()
    counts = []
    for seed, sizes in enumerate([[(9, [5, 3]), (20, [2, 9])],  # two rows, then other lengths and row counts
                                  [(31, [4, 4, 4]), (7, [1, 2, 3]), (12, [11, 3, 2])],
                                  [(40, [6, 2])],  # one row
                                  [(3, [30, 1]), (17, [8, 8]), (5, [2, 2]), (26, [3, 13])],
                                  [(60, [4, 9])],
                                  [(8, [19, 3]), (50, [7, 1])]]):
        batch = groups(sizes, seed)
        logp, _, _, _ = compiled(batch)
        logp.sum().backward()
        counts.append(compiled_training.compilations() - start)
    compiled.policy.zero_grad(set_to_none=True)
    assert compiled_training.FAILED is None
    assert counts[-1] <= 4 and counts[-1] == counts[2]  # nothing new after each kind was seen once


@pytest.mark.slow
def test_a_run_with_compiled_training(tiny_model_dir, monkeypatch):
    """Claim: `--compile-train on` trains end to end (sync mode, two iterations of the tiny model) through compiled
    layers, and iteration 0, sampled by the same θ_0 in both runs, has the eager run's loss and gradient norm up to
    float rounding (a relative 1e-4, far above `rounding_bound`'s ~2e-5 for its sums and far below a real
    difference)."""
    eager = run_training(make_cfg(tiny_model_dir, "--mode", "sync", "--iterations", "2", "--eval-every", "0"))[1]
    entered = []
    layers = compiled_step.compiled_layers
    monkeypatch.setattr(compiled_step, "compiled_layers", lambda *args: entered.append(args) or layers(*args))
    cfg = make_cfg(tiny_model_dir, "--mode", "sync", "--iterations", "2", "--eval-every", "0", "--compile-train", "on")
    _, rows = run_training(cfg)
    assert compiled_training.FAILED is None and entered and all(dynamic for _, dynamic in entered)
    assert len([row for row in rows if not row.get("final")]) == 2
    for name in ("loss", "grad_norm"):
        assert rows[0][name] == pytest.approx(eager[0][name], rel=1e-4, abs=1e-6)


def test_compile_train_is_said_in_the_first_line_and_refused_with_checkpointing():
    """Claim: --compile-train on is said in the run's first line with its one-time cost, auto (the default) compiles
    nothing, and --compile-train on with --gradient-checkpointing is one line naming both."""
    assert "training compiled" in start_line(Config(model="m", out="o", compile_train="on", device="cpu"), 9, 1)
    assert "training compiled" not in start_line(Config(model="m", out="o", device="cpu"), 9, 1)
    problems = validate(Config(compile_train="on", gradient_checkpointing=True))
    refusal = "--compile-train on (TRL: --torch-compile) and --gradient-checkpointing cannot be combined"
    assert any(refusal in line for line in problems)


def test_a_failed_compilation_scores_eagerly_after_one_line(tiny_model_dir, monkeypatch, capsys):
    """Claim: when torch.compile fails (here: Dynamo raising as a missing C++ compiler makes it), the training side
    says so in one line on stderr and scores eagerly from then on: the same log-probs as the eager scorer, bit for
    bit, and no second attempt."""
    from torch._dynamo.exc import BackendCompilerFailed

    policy, _ = load_model(str(tiny_model_dir))
    eager = logprobs_fn(policy, "packed", 1.0, 1, 1, dense_mask=True)
    attempts = []

    def failing(decoder, dynamic):
        attempts.append(dynamic)
        raise BackendCompilerFailed("inductor", RuntimeError("no C++ compiler found"), None)
    monkeypatch.setattr(compiled_step, "compiled_layers", failing)
    monkeypatch.setattr(compiled_training, "FAILED", None)
    scorer = compiled_training.compiled_scorer(eager)
    capsys.readouterr()  # (the model's loading bar)
    batch = groups([(6, [3, 4]), (9, [2, 5])])
    for _ in range(2):
        logp, mask = scorer(policy, batch)
        assert torch.equal(logp, eager(policy, batch)[0])
    lines = capsys.readouterr().err.strip().splitlines()
    assert attempts == [True] and len(lines) == 1 and "training without it" in lines[0]
    assert "no C++ compiler found" in compiled_training.FAILED
