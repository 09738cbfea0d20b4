"""The entry point end to end, in a subprocess: a 2-iteration run logs, writes metrics and saves a loadable model."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GSM8K_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow  # process-level: `python -m pytest -m slow` (CI runs both tiers)

ROOT = Path(__file__).resolve().parents[2]
GSM8K = GSM8K_DIR / "train.jsonl"


def split_threads(mode: str) -> list[str]:
    """Async with one thread per side: an inference process samples (at the defaults on 2 cores the probe may have
    the sides sample then train, and async then samples in the trainer's process: launch.setup.async_runs_as_sync)."""
    return ["--rollout-threads", "1", "--train-threads", "1"] if mode == "async" else []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_iterations_of_trainer_py(tiny_model_dir, tmp_path, mode):
    """Claim: `python trainer.py` runs 2 iterations in either mode, prints one line per iteration, writes the
    same figures to metrics.jsonl, and saves a Hugging Face directory that from_pretrained loads."""
    result = subprocess.run(
        [sys.executable, "trainer.py", "--model", str(tiny_model_dir), "--data", "arithmetic", "--mode", mode,
         "--iterations", "2", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "4",
         "--eval-every", "1", "--eval-size", "4", "--out", str(tmp_path), "--trace", str(tmp_path / "trace.json"),
         "--groups-per-call", "2", *split_threads(mode)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\niter ") == 2 and "final  held-out reward" in result.stdout
    assert "sizes: --groups-per-call 2 (2 generate call(s) per iteration)" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[-1]["final"]
    for key in ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completions/mean_length", "generate_s",
                "train_s", "idle_inference_s", "idle_training_s", "overlap", "tokens_per_s"):
        assert key in rows[0], key
    train = int(re.search(r"\| (\d+) train / ", result.stdout)[1])  # TRL's epoch: 4 prompts an iteration
    assert [r["epoch"] for r in rows[:2]] == [4 / train, 8 / train]
    assert 0 < rows[0]["num_tokens"] < rows[1]["num_tokens"] and "input_tokens" not in rows[0]
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace}
    assert "generate groups 0-1" in names and "train 2 groups" in names and "optimizer step 0" in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    ids = torch.tensor([tokenizer.encode("12+7=", add_special_tokens=False)])
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gsm8k_file_with_a_qwen_instruct_shaped_directory(qwen_shaped_dir, tmp_path, mode):
    """Claim: the real-model path end to end: a local directory shaped like Qwen2.5-Instruct (chat template, two EOS
    ids, Qwen's shipped sampling defaults) trains on a GSM8K-format JSONL file in either mode."""
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} not present")
    result = subprocess.run(
        [sys.executable, "trainer.py", "--model", str(qwen_shaped_dir), "--data", str(GSM8K), "--mode", mode,
         "--iterations", "1", "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "8",
         "--eval-every", "0", "--no-save", "--out", str(tmp_path), *split_threads(mode)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "7473 train" in result.stdout
    assert "no held-out evaluation ran" in result.stdout and "None -> None" not in result.stdout  # --eval-every 0


def test_an_evaluation_no_reward_scored_is_not_said_to_have_not_run(tiny_model_dir, tmp_path, capsys):
    """Claim: when a TRL-style reward returns None for every response, the last line says the held-out evaluation
    scored nothing, not that none ran (a line of the run's: checked in this process)."""
    import trainer
    (tmp_path / "skip.py").write_text("def skip(prompts, completions, **kwargs):\n"
                                      "    return [None] * len(completions)\n")
    code = trainer.main(["--model", str(tiny_model_dir), "--data", "arithmetic", "--reward",
                         f"{tmp_path / 'skip.py'}:skip", "--iterations", "1", "--batch-size", "8",
                         "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "1", "--eval-size", "4",
                         "--no-save", "--out", str(tmp_path / "run"), "--mode", "sync", "--sizes", "rule"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "held-out rewards: none scored" in out and "no held-out evaluation ran" not in out
