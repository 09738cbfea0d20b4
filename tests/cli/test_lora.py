"""LoRA through peft (--use-peft): the reference is the base with the adapter off (no copy), only the adapter is
published, checkpointed and saved, and the run's exactness claims (async == sync, resume) hold with it."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

import engine  # noqa: E402
import weights  # noqa: E402
from infra.models import load_model  # noqa: E402
from infra.command_line import parse_args  # noqa: E402
from launch import remote  # noqa: E402
import trainer  # noqa: E402
from packing import batch_logprobs, logprobs_fn  # noqa: E402
from tri_model import TriModel  # noqa: E402
from launch import run_output  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LORA = dict(r=4, alpha=8, dropout=0.0, target_modules=None, seed=0)
TIMINGS = ("_s", "overlap", "tokens_per_s", "elapsed")  # what differs between two runs of the same computation


def group(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 90, (6,), generator=g)
    responses = [torch.randint(3, 90, (n,), generator=g) for n in (3, 5, 2, 4)]
    return [(prompt, responses)]


def adapter(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if "lora_" in name]


def move_adapter(model, seed: int = 1, scale: float = 0.5) -> None:
    """An adapter that changes the outputs (B starts at 0: the model would compute the base exactly)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter(model):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_the_reference_is_the_base_with_the_adapter_off_bitwise(tiny_model_dir):
    """Claim: with an adapter the tri-model makes no copy of the model: ref_logp (the policy with peft's adapter
    off) equals the plain base model's log-probs bitwise, however far the adapter has moved; only the adapter is
    trainable; the reference takes no bytes and the old policy (N > 1 updates) only the adapter's."""
    policy, _ = load_model(str(tiny_model_dir), lora=LORA)
    base, _ = load_model(str(tiny_model_dir))
    tri = TriModel(policy, logprobs_fn(policy), use_reference=True, use_old=True, adapter_off=policy.disable_adapter)
    move_adapter(policy)
    policy.train()
    logp, _, ref_logp, mask = tri(group())
    base.train()
    expected, expected_mask = logprobs_fn(base)(base, group())
    assert torch.equal(ref_logp, expected) and torch.equal(mask, expected_mask)
    assert not torch.allclose(logp, ref_logp), "the adapter moved: the policy must differ from the reference"
    assert {id(p) for p in policy.parameters() if p.requires_grad} == {id(p) for p in adapter(policy)}
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapter(policy))
    report = tri.memory_report()
    assert report["reference_bytes"] == 0 and report["old_bytes"] == adapter_bytes
    assert tri.reference is None and tri.old is None


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_the_old_policy_is_the_adapter_at_the_iteration_start(tiny_model_dir, dropout):
    """Claim: with N > 1 updates the old policy is a copy of the adapter alone: after an optimizer step old_logp
    still equals, bitwise, what the policy scored at θ_k; the policy's own log-probs and its weights are left as
    they were by the swap; with --lora-dropout the old forward runs without dropout, as a frozen copy does."""
    policy, _ = load_model(str(tiny_model_dir), lora={**LORA, "dropout": dropout})
    tri = TriModel(policy, logprobs_fn(policy), use_reference=False, use_old=True, adapter_off=policy.disable_adapter)
    move_adapter(policy)
    policy.train()
    tri.start_iteration()
    with torch.no_grad(), torch.random.fork_rng():
        policy.eval()  # θ_k without dropout
        at_k = batch_logprobs(policy, group())[0]
        policy.train()
    optimizer = torch.optim.SGD(weights.published(policy), lr=1.0)
    logp, old_logp, _, mask = tri(group())
    (-(logp * mask).sum()).backward()
    optimizer.step()
    after = [p.detach().clone() for p in adapter(policy)]
    logp, old_logp, _, _ = tri(group())
    assert torch.equal(old_logp, at_k)
    assert all(torch.equal(p, q) for p, q in zip(adapter(policy), after)), "the swap must restore the adapter"
    if dropout == 0:
        with torch.no_grad():
            assert torch.equal(logp, batch_logprobs(policy, group())[0])
        assert not torch.allclose(logp, old_logp)


def test_only_the_adapter_is_published(tiny_model_dir):
    """Claim: the weight buffer (and the flat tensor broadcast to inference ranks) holds the adapter alone: r = 4 on
    q_proj (128 -> 128) and v_proj (128 -> 64) of the tiny model's 2 layers is 3,584 parameters, 14,336 bytes in
    float32, against the model's 1.3 MB; an inference copy that loaded the base once and attached to the buffer
    then computes bitwise what the trainer's policy computes, whatever its own adapter was."""
    policy, _ = load_model(str(tiny_model_dir), lora=LORA)
    receiver, _ = load_model(str(tiny_model_dir), lora={**LORA, "seed": 7})  # another adapter: overwritten
    move_adapter(policy)
    published = sum(p.numel() for p in adapter(policy))
    assert published == 2 * ((4 * 128 + 128 * 4) + (4 * 128 + 64 * 4)) == 3584
    buffer = weights.WeightBuffer(policy)
    assert buffer.flat.nbytes == 4 * published == 14336
    assert sum(p.numel() * p.element_size() for p in policy.parameters()) > 90 * buffer.flat.nbytes
    assert remote.flat_like(policy, torch.float32, "cpu").numel() == published
    buffer.attach(receiver)
    buffer.publish(policy, 0)
    buffer.load_into(receiver, expected_version=0)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(receiver(input_ids=ids).logits, policy(input_ids=ids).logits)
    bf16, _ = load_model(str(tiny_model_dir), dtype=torch.bfloat16, lora=LORA)  # a bf16 inference side's adapter is
    assert {p.dtype for p in weights.published(bf16)} == {torch.bfloat16}  # bf16 too: it aliases the bf16 buffer
    bf16_buffer = weights.WeightBuffer(policy, torch.bfloat16)
    bf16_buffer.attach(bf16)
    assert bf16_buffer.aliased and bf16_buffer.flat.nbytes == 2 * published


def test_the_engine_samples_through_the_adapter(tiny_model_dir):
    """Claim: engine.py samples from the peft-wrapped model (no fall-back to generate): with the adapter off it draws
    exactly the base model's tokens, with a moved adapter other tokens."""
    policy, _ = load_model(str(tiny_model_dir), lora=LORA)
    base, _ = load_model(str(tiny_model_dir))
    assert engine.unsupported_reason(policy) is None
    move_adapter(policy, scale=2.0)

    def sample(model):
        return engine.sample_groups(model.eval(), [[5, 6, 7], [8, 9]], 4, max_new_tokens=6, stop_ids=[0],
                                    keys=[(0, 0, 0), (0, 0, 1)])
    with torch.no_grad():
        with policy.disable_adapter():
            assert sample(policy) == sample(base)
        assert sample(policy) != sample(base)


# --- whole runs ---
def make_cfg(model_dir, *extra):
    return parse_args(["--model", str(model_dir), "--data", "arithmetic", "--reward", "tests/rewards.py:digit_fraction",
                       "--iterations", "3", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "6",
                       "--eval-every", "2", "--eval-size", "4", "--eval-samples", "2", "--lr", "1e-2", "--no-save",
                       "--sizes", "rule", "--rollout-threads", "1", "--train-threads", "1", "--use-peft",
                       "--lora-r", "4", "--lora-alpha", "8", *map(str, extra)])


def run_training(cfg, resume_from=None):
    with trainer.started(cfg, resume_from) as (rows, policy, tokenizer):
        return policy, tokenizer, [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]


def test_async_equals_sync_bitwise_with_lora(tiny_model_dir):
    """Claim: with --use-peft, async (the inference process receives only the adapter each iteration) and sync are
    bitwise the same run: metrics and adapter weights, with 2 updates per iteration (the old policy as an adapter
    copy) and the KL to the reference (the adapter off)."""
    extra = ["--updates-per-iteration", "2", "--epsilon-low", "0.01", "--epsilon-high", "0.01"]
    sync_policy, _, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", *extra))
    async_policy, _, async_rows = run_training(make_cfg(tiny_model_dir, "--mode", "async", *extra))
    initial, _ = load_model(str(tiny_model_dir), lora=make_cfg(tiny_model_dir).lora)
    moved = max((p - q).abs().max().item() for p, q in zip(adapter(sync_policy), adapter(initial)))
    assert moved > 1e-3, "training did not change the adapter: the comparison would be vacuous"
    assert all(torch.equal(p, q) for p, q in zip(sync_policy.parameters(), async_policy.parameters()))
    assert sync_rows == async_rows and len(sync_rows) == 4
    assert max(row["kl"] for row in sync_rows[:-1]) > 0


def test_resume_and_the_saved_policy_with_lora(tiny_model_dir, tmp_path):
    """Claim: a run resumed from a LoRA checkpoint (policy/ holds the adapter alone, peft's format, and AdamW's
    state of the adapter) ends bitwise where the uninterrupted run ends; the final policy/ is peft's adapter
    directory (adapter_config.json, adapter_model.safetensors; no full model) and PeftModel.from_pretrained on the
    base loads it to the trained policy's exact outputs."""
    from peft import PeftModel

    cfg = make_cfg(tiny_model_dir, "--mode", "sync", "--save-every", "1", "--keep-checkpoints", "0", "--out", tmp_path)
    straight, tokenizer, straight_rows = run_training(cfg)
    saved = tmp_path / "checkpoint-2" / "policy"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in saved.iterdir()}
    assert not (saved / "model.safetensors").exists()
    resumed, _, resumed_rows = run_training(cfg, resume_from=tmp_path / "checkpoint-2")
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))
    assert resumed_rows == straight_rows[2:]

    run_output.save_policy(straight, tokenizer, tmp_path / "policy")
    assert not (tmp_path / "policy" / "model.safetensors").exists()
    base, _ = load_model(str(tiny_model_dir))
    loaded = PeftModel.from_pretrained(base, tmp_path / "policy")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, straight.eval()(input_ids=ids).logits)


def test_without_peft_the_option_is_one_line(tiny_model_dir, tmp_path):
    """Claim: peft is imported only when --use-peft asks for it (the modules that load, wrap, score and publish
    leave it out), and without peft installed (hidden here) the run ends with one line naming the fix and exit code 1,
    no traceback. (transformers.trainer_utils imports peft whenever it is installed: not imported here.)"""
    hide = ("import sys, infra.models, infra.checkpoint, tri_model, weights, inference, engine, rollout; "
            "assert 'peft' not in sys.modules, 'imported'; import trainer; "
            "sys.modules['peft'] = None; "
            f"sys.exit(trainer.main(['--model', {str(tiny_model_dir)!r}, '--mode', 'sync', '--data', 'arithmetic', "
            f"'--out', {str(tmp_path / 'out')!r}, '--use-peft']))")
    result = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "error: --use-peft trains a LoRA adapter with peft, which is not installed: pip install peft"], result.stderr


def test_a_lora_runs_policy_loads_as_its_base_with_the_adapter_merged(tiny_model_dir, tmp_path):
    """Claim: a --use-peft run's policy/ (peft's adapter folder) given as --model loads as the model it makes, its
    base with the adapter merged in (W_0 + (alpha / r)·B A), every weight trainable: transformers alone loads it
    unmerged and frozen, and the run ended in "optimizer got an empty parameter list". Its logits equal the peft
    model's up to the merge's rounding: W_0 x + s·B(A x) against (W_0 + s·B A) x in float32, each logit a sum over
    128-wide dot products of O(1) terms, so a few float32 ulps of their magnitude (1e-5 relative, 1e-5 absolute).
    With --use-peft it is refused in one line: a new adapter would be saved against the base alone, without it."""
    from infra.models import ModelError
    policy, tokenizer = load_model(str(tiny_model_dir), lora=LORA)
    move_adapter(policy)
    adapter_dir = tmp_path / "policy"
    policy.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    merged, _ = load_model(str(adapter_dir))
    assert not hasattr(merged, "peft_config") and all(p.requires_grad for p in merged.parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base, _ = load_model(str(tiny_model_dir))
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, expected, rtol=1e-3, atol=1e-3)  # the adapter counts
    with pytest.raises(ModelError, match="--use-peft with model .*a LoRA adapter"):
        load_model(str(adapter_dir), lora=LORA)


def test_lora_options_are_checked_before_training(tiny_model_dir, tmp_path, capsys):
    """Claim: a --lora-target-modules name that matches no module (a typo beside a right one, which peft accepts,
    adapting the right one alone) is one line naming it and the model's linear layers; --lora-r 0 (or a bad alpha or
    dropout) is refused as options are read, before any model loads; --lora-* without --use-peft is one line saying
    they are ignored (as TRL ignores them) and every weight is trained; peft's warnings (a tied layer in the adapter)
    come as one `periodic-rl: peft:` line each, without peft's file paths on stderr, and a save adds none."""
    import warnings
    from infra.models import ModelError
    with pytest.raises(ModelError, match=r"^--lora-target-modules qproj: no module of Qwen2ForCausalLM is named so "
                                         r"\(its linear layers: down_proj gate_proj k_proj lm_head o_proj q_proj "
                                         r"up_proj v_proj; or all-linear\)$"):
        load_model(str(tiny_model_dir), lora={**LORA, "target_modules": ["q_proj", "qproj"]})
    capsys.readouterr()  # (transformers' progress bar)
    for argv, refusal in ((["--lora-r", "0"], "--lora-r must be at least 1"),
                          (["--lora-alpha", "0"], "--lora-alpha must be positive"),
                          (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)")):
        with pytest.raises(SystemExit):
            parse_args(["--use-peft", *argv])
        assert capsys.readouterr().err.startswith(f"trainer.py: error: {refusal}")
    cfg = parse_args(["--lora-r", "8", "--lora-target-modules", "q_proj"])
    assert not cfg.use_peft and cfg.lora is None
    assert capsys.readouterr().out == ("periodic-rl: ignored --lora-r, --lora-target-modules: the LoRA adapter's "
                                       "settings, and --use-peft is off: every weight is trained (add --use-peft to "
                                       "train an adapter)\n")
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        policy, _ = load_model(str(tiny_model_dir), lora={**LORA, "target_modules": ["lm_head", "q_proj"]})
        policy.save_pretrained(tmp_path / "adapter")
    assert not [w for w in raised if "peft" in Path(w.filename).parts], [str(w.message) for w in raised]
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("periodic-rl: peft: Model has `tie_word_embeddings=True` and a tied "
                                                 "layer is part of the adapter"), said
