"""The benchmarks' pieces (benchmarks/) run and compute what they say (the timings themselves are never asserted)."""
import time
from pathlib import Path

import pytest
import torch

from benchmarks.common import T_975, not_slower, ratio_interval
from benchmarks.memory import LiveTensorBytes
from benchmarks.pipeline import async_workload, pipeline_bound
from benchmarks.shared_prompt import forward_macs, mac_ceiling, shared_prompt_cell
from launch.sizing import split_seconds
import warm


def test_pipeline_bound():
    """Claim: the fill/drain-aware bound is 1 for one group, approaches the ideal bound with many groups,
    and never exceeds it."""
    assert pipeline_bound(2.0, 1.0, 1) == pytest.approx(1.0)
    assert pipeline_bound(1.0, 1.0, 8) == pytest.approx(16 / 9)  # 2n / (n + 1), balanced
    for t_gen, t_train in [(1.0, 1.0), (3.0, 1.0), (0.5, 2.0)]:
        ideal = (t_gen + t_train) / max(t_gen, t_train)
        bounds = [pipeline_bound(t_gen, t_train, n) for n in (1, 2, 4, 16, 10_000)]
        assert bounds == sorted(bounds) and bounds[-1] <= ideal and bounds[-1] == pytest.approx(ideal, rel=1e-3)


def test_ratio_interval_fails_only_what_the_rounds_show():
    """Claim (the "async not slower than sync" checks): the interval is centred on the ratios' geometric mean, narrows
    as the same spread is seen over more rounds, holds 1x when rounds go either way, lies below 1x when every round
    is slower by more than the spread, has no width without spread and no bounds from one round; t beyond the
    table (30 degrees of freedom) continues it: 1.96 + 2.4/31 is within 0.005 of t(31) = 2.040. `not_slower` also
    fails a mean below 0.97x that three noisy rounds cannot place below 1x."""
    either_way = ratio_interval([1.1, 0.9, 1.0])
    assert either_way[0] == pytest.approx((1.1 * 0.9 * 1.0) ** (1 / 3)) and either_way[1] < 1 < either_way[2]
    wider, narrower = ratio_interval([1.1, 0.9] * 2), ratio_interval([1.1, 0.9] * 8)
    assert narrower[1] > wider[1] and narrower[2] < wider[2]
    assert ratio_interval([0.97, 0.98, 0.99, 0.96, 0.98, 0.97])[2] < 1.0  # slower in every round
    assert not not_slower([0.97, 0.98, 0.99, 0.96, 0.98, 0.97]) and not_slower([1.1, 0.9, 1.0])
    assert ratio_interval([0.85, 1.05, 0.95])[2] >= 1.0 and not not_slower([0.85, 1.05, 0.95])  # mean 0.95x
    assert ratio_interval([1.02] * 4) == pytest.approx((1.02, 1.02, 1.02))
    assert ratio_interval([0.8]) == (pytest.approx(0.8), 0.0, float("inf"))
    assert abs(1.96 + 2.4 / 31 - 2.040) < 0.005 and T_975[-1] == 2.042


def test_split_prediction():
    """Claim: the split model (sizing.split_seconds) is the one-device pipeline for 1 + 1 (its bound's denominator);
    with a device per call the iteration is one call's sampling plus all the training (nothing left to overlap);
    training devices divide the training."""
    assert split_seconds(4.0, 1.0, 4) == pytest.approx((4.0 + 1.0) / pipeline_bound(4.0, 1.0, 4))
    assert split_seconds(4.0, 1.0, 4, inference=4) == pytest.approx(4.0 / 4 + 1.0)
    assert split_seconds(4.0, 1.0, 4, inference=2) < split_seconds(4.0, 1.0, 4)
    assert split_seconds(1.0, 4.0, 4, training=4) == pytest.approx(split_seconds(1.0, 1.0, 4))


@pytest.mark.slow
def test_async_workload_reports_the_promised_figures(tiny_model_dir):
    """Claim: one sync/async round on a local model yields the JSON keys its docstring lists, consistent
    with each other, at the sizes async's probe picked (both modes at its generate calls)."""
    argv = ["--model", str(tiny_model_dir), "--data", "arithmetic", "--batch-size", "8", "--group-size", "4",
            "--max-new-tokens", "3"]
    row = async_workload(argv, iterations=1, rounds=1)
    for key in ("sync_s_per_iter", "async_s_per_iter", "speedup", "ideal_speedup", "pipeline_bound"):
        assert row[key] > 0, key
    assert row["speedup"] == pytest.approx(row["sync_s_per_iter"] / row["async_s_per_iter"])
    assert row["speedup_per_round"] == [pytest.approx(row["speedup"])]
    assert row["sizes"].startswith(f"--groups-per-call {2 // row['calls_per_iteration']} --micro-batch-tokens ")
    assert row["calls_per_iteration"] in (1, 2) and row["pipeline_bound"] <= row["ideal_speedup"]
    assert row["predicted_speedup"] > 0  # the probe ran
    # the bound: from async's own spans, which a perfect pipeline could at best reach (never faster than it ran)
    assert 0 < row["efficiency"] <= 1 and row["bound"] == pytest.approx(row["speedup"] / row["efficiency"])


def test_shared_prompt_cell_measures_all_modes():
    """Claim: a grid cell times packed, unpacked and auto, and the packed layout saves less for backward
    (deterministic, unlike time)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").train()
    row = shared_prompt_cell(model, P=24, R=4, G=4, repeats=1, device="cpu", now=time.perf_counter)
    assert min(row["packed_s"], row["unpacked_s"], row["auto_s"]) > 0
    assert row["token_ratio"] == pytest.approx(4 * 28 / 40)
    assert row["memory_packed_bytes"] < row["memory_unpacked_bytes"]
    assert row["auto_choice"] == ("packed" if row["predicted_packed_over_unpacked"] < 1 else "unpacked")


def test_forward_macs_counts_tokens_and_the_masks_pairs():
    """Claim: the MAC ceiling's count uses G(P+R) vs P+GR tokens and exactly the score pairs the two masks
    allow (checked against attention.shared_prompt_mask), with the lm head on the same G·R positions."""
    from types import SimpleNamespace

    import torch

    import attention
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, intermediate_size=16, vocab_size=10)
    P, R, G = 5, 3, 4
    per_token = 8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16
    per_pair = 2 * 2 * 4
    lm_head = G * R * 8 * 10
    packed_pairs = int(attention.shared_prompt_mask(attention.pack([(torch.arange(P), [torch.arange(R)] * G)])
                                                    .segment_ids).sum())
    unpacked_pairs = G * (P + R) * (P + R + 1) // 2  # G causal rows
    assert forward_macs(config, P, R, G, packed=True) == (2 * ((P + G * R) * per_token + packed_pairs * per_pair)
                                                          + lm_head)
    assert forward_macs(config, P, R, G, packed=False) == (2 * (G * (P + R) * per_token + unpacked_pairs * per_pair)
                                                           + lm_head)
    assert 1 < mac_ceiling(config, P, R, G) < G * (P + R) / (P + G * R)  # attention and lm head shrink less


def test_live_tensor_bytes_counts_what_is_alive():
    """Claim: LiveTensorBytes (bench.py memory) counts the tensors given and every storage made inside, uncounts the
    freed ones, and keeps the peak: a 4 MiB temporary freed before two 8 MiB tensors alive together (an operand and
    its product) gives a peak of 16 MiB + the input, and the operand, once freed, is no longer live."""
    x = torch.zeros(2**20)  # 4 MiB, counted as existing
    with LiveTensorBytes([x]) as tracker:
        y = x + 1  # 4 MiB
        del y
        z = torch.zeros(2 * 2**20) * 2  # 8 MiB operand and 8 MiB product; the operand is freed after the line
    assert tracker.live == x.nbytes + z.nbytes
    assert tracker.peak == x.nbytes + 2 * z.nbytes


def test_peer_workload_and_its_errors(tmp_path, monkeypatch):
    """Claim (bench.py peer): a task names its tiny model and token limit; --model DIR goes with --data and is
    passed as an absolute path (both sides run from the repository root), a model name (bench.py gpu's dry run:
    tiny) as it is; --data alone is refused in one line."""
    import argparse

    from benchmarks.peer import PEER_TASKS, workload
    args = argparse.Namespace(task="chain", model=None, data=None)
    assert workload(args) == PEER_TASKS["chain"] == ("tiny-chain", 128)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert workload(argparse.Namespace(task="arithmetic", model="m", data="d")) == (str(tmp_path / "m"), 512)
    assert workload(argparse.Namespace(task="arithmetic", model="tiny", data="d")) == ("tiny", 512)
    for bad, says in [(dict(model="m", data=None), "needs --data"), (dict(model=None, data="d"), "goes with --model")]:
        with pytest.raises(SystemExit, match=says):
            workload(argparse.Namespace(task="arithmetic", **bad))


def test_trl_script_micro_batch_divides_the_step(monkeypatch):
    """Claim (tools/trl_grpo_run.py): --micro-batch must divide the step's completions (it sets gradient accumulation
    = steps per generation = completions / micro-batch); --data goes with a model directory and only with one."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what the script sets on import: restored after this test
    from tools.trl_grpo_run import parse_args
    assert parse_args(["--micro-batch", "16"]).micro_batch == 16
    for argv in (["--micro-batch", "48"], ["--micro-batch", "0"], ["--data", "d"], ["--model", "some/dir"],
                 ["--threads", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


LAYOUTS = ["structured", "dense", "unpacked", "dense-padded", "unpacked-padded"]


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[], ["--vary-lengths", "--layouts", *LAYOUTS, "--pad-to-multiple-of", "8"]])
def test_train_step_layouts_compute_the_same_step(lengths, monkeypatch, capsys):
    """Claim (tools/train_step_layouts.py): its layouts (the structured kernel forced, the dense mask, plain rows,
    and the last two padded to a multiple of 8) compute the same micro-batch, so their timings compare like with
    like. In float32 on CPU each layout's
    gradient is within 1e-5 of plain rows' (relative norm), the bound test_packing.py holds for every parameter;
    a layout that dropped or misplaced a token would be off by far more. With --vary-lengths every repeat draws
    another batch and each layout is compared on it. The script's main runs in this process."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import train_step_layouts
    monkeypatch.setattr(sys, "argv", ["train_step_layouts.py", "--small", "--device", "cpu", "--groups", "2",
                                      "--prompt", "12", "--response", "6", "--repeats", "2", *lengths])
    state = torch.get_rng_state()  # the script seeds the global generator: restored after it
    try:
        train_step_layouts.main()
    finally:
        torch.set_rng_state(state)
    rows = dict(re.findall(r"repeat 1 ([\w-]+) .* grad vs unpacked (\S+)", capsys.readouterr().out))
    assert list(rows) == (LAYOUTS if lengths else LAYOUTS[:3])
    assert all(float(off) <= 1e-5 for off in rows.values()), rows
    assert float(rows["unpacked"]) == 0.0  # plain rows against the warm-up's: the same computation, bit for bit (with
    # --vary-lengths the reference is this repeat's plain rows themselves)


def test_engine_cpu_benchmark_runs_and_splits_the_time(tmp_path, capsys):
    """Claim (benchmarks/engine_cpu.py, the CPU target's command): it times the engine against `generate` and splits
    each side's time, at a small size, so that a change in the engine's methods cannot break it unnoticed (one did:
    GenerateCall.draw took a new keyword and the split's stand-in refused it). Timings are not asserted, only that each
    figure was printed."""
    import json

    from benchmarks import engine_cpu
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {a} apples. How many now?", "answer": "#### 1"}) + "\n"
                            for a in range(3)))
    engine_cpu.main(["--data", str(data), "--layers", "1", "--vocab", "512", "--prompts", "2", "--group-size", "2",
                     "--max-new-tokens", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "round 0: engine" in out and "ratio hf/engine" in out and "engine split: total" in out, out
    assert "hf split: total" in out, out


@pytest.mark.slow
def test_gpu_table_runs_every_part_on_cpu(qwen_shaped_dir, tmp_path):
    """Claim (bench.py gpu): the one-command GPU table's every part runs end to end, so that a lent GPU's
    minutes go to measuring: on CPU (no CUDA graphs there) the decode part times the engine and `generate` at 1,
    M/2 and M new tokens and derives per-step figures from them, the kernels part counts what a decode step launches
    (exactly: a 1-layer Qwen2 step makes 8 matrix products), the pipeline part runs trainer.py sync, async and auto
    (rows to the cap: --tail both's order of runs is the next test's, and `python -m benchmarks.tail trainer.py`,
    sync and async, test_the_tail_reaches_the_inference_process's) on a chat model with GSM8K-shaped data, and the
    peer part, given a Python without trl, is skipped with the reason (its TRL run is `bench.py peer`'s, tested
    above). Timings are not asserted, only that they were measured."""
    import json
    import math
    import subprocess
    import sys

    data = tmp_path / "gsm8k"
    data.mkdir()
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
             "answer": f"He has {a} + {b} = {a + b}.\n#### {a + b}"} for a in range(3, 40) for b in (2, 5)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:60]))
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[60:]))
    figures = tmp_path / "gpu.json"
    command = [sys.executable, "bench.py", "gpu", "--device", "cpu", "--layers", "1", "--vocab", "512", "--prompts", "2",
               "--group-size", "2", "--decode-tokens", "6", "--rounds", "1", "--model", str(qwen_shaped_dir), "--data",
               str(data), "--train-tokens", "4", "--iterations", "1", "--peer-rounds", "1", "--trl-python",
               str(tmp_path / "no-python"), "--json", str(figures),
               "--tail", "off", "--trainer-args", "--sizes rule"]  # no probe: the trainer runs only have to run
    done = warm.run(command, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads(figures.read_text())
    sides = table["decode"]["sides"]
    assert set(sides) == {"engine, eager", "hf generate"} and not table["decode"]["failed"]
    for name, side in sides.items():
        assert side["prefill_tokens_per_s"] > 0 and all(len(side["seconds"][m]) == 1 for m in ("1", "3", "6"))
        each = side["decode_ms_each_round"]  # each round's figure, printed beside the median
        assert len(each) == 1 and f"gpu decode: round 0: {name:24s} decode {each[0]:.2f} ms per step" in done.stdout
        assert math.isfinite(side["decode_ms"])  # a difference of two timings: its sign is the machine's load
    kernels = table["kernels"]["sides"]["engine, eager"]  # one layer: q, k, v (with bias), o, gate, up, down, head
    assert kernels["by_kind"]["matrix products"][0] == 8 and kernels["kernels_per_step"] > 8, kernels["by_kind"]
    pipeline = table["pipeline"]  # sync, async and auto, to the cap
    assert sorted(pipeline["seconds_per_iteration"]) == ["async", "auto", "sync"]
    assert [len(seconds) for seconds in pipeline["seconds_per_iteration"].values()] == [1] * 3
    assert pipeline["auto"] == "async" and "--mode auto here: async" in done.stdout  # CPU: core groups
    assert "skipped" in table["peer"] and "cannot import trl" in done.stdout


def test_the_pipeline_part_runs_each_mode_to_the_cap_and_with_the_tail(monkeypatch, capsys):
    """Claim (bench.py gpu --parts pipeline, --tail both: the default): each round runs trainer.py sync, async and auto
    to the cap, then the same three with the tail, each once per round, and compares async and auto with sync of
    the same tail. The runs here are stand-ins returning set figures (the runs themselves are the previous test's)."""
    import argparse

    from benchmarks import gpu
    runs = []

    def stand_in(name, argv, run, tailed):
        runs.append((name, argv, tailed))
        return (2.0 if argv == ["--mode", "sync"] else 1.0), 10.0, "", 0.5
    monkeypatch.setattr(gpu, "peer_run", stand_in)
    parser = argparse.ArgumentParser()
    gpu.gpu_args(parser)
    args = parser.parse_args(["--device", "cpu", "--peer-rounds", "2", "--iterations", "1"])
    figures = gpu.pipeline_part(args, "tiny")
    labels = ["sync", "async", "auto", "sync +tail", "async +tail", "auto +tail"]
    assert runs == [(f"periodic-rl {label}", ["--mode", label.split()[0]], label.endswith("+tail"))
                    for label in labels] * 2
    assert figures["seconds_per_iteration"] == {label: [2.0 if label.startswith("sync") else 1.0] * 2
                                                for label in labels}
    assert figures["vs_sync"] == {label: [2.0, 2.0] for label in labels if not label.startswith("sync")}
    assert "gpu pipeline: auto +tail 2.00x sync" in capsys.readouterr().out


@pytest.mark.slow
def test_decode_step_parts_run_every_variant_on_cpu(capsys):
    """Claim (tools/decode_step_parts.py): every variant of the step's pieces runs (on CPU, eagerly, at a
    small size), so that a lent GPU's minutes go to measuring, and the agreement lines a GPU run reads are printed
    and hold here (each timing printed as the median beside its 5 rounds): flex attention over the written blocks
    agrees with sdpa under the mask (two float32 softmax
    attentions over 128 slots of unit-variance scores: within 2e-4), the compiled draw with the eager draw."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import decode_step_parts
    decode_step_parts.main(["--device", "cpu", "--rows", "8", "--vocab", "2048", "--length", "128", "--repeat", "1"])
    out = capsys.readouterr().out
    timed = re.findall(r"^    (\S.*?)\s+(\d+\.\d) us  \(each round: (?:\d+\.\d, ){4}\d+\.\d\)$", out, flags=re.M)
    assert len(timed) >= 11, out  # attention 5 of 7 (cuDNN and memory-efficient are CUDA's), draw 6
    differences = [float(value) for value in re.findall(r"largest difference (\S+)$", out, flags=re.M)]
    assert len(differences) == 1 and differences[0] < 2e-4, out
    agreed = re.search(r"compiled draw = eager draw: \[(\d+), (\d+), (\d+)\] of 8 tokens", out)
    assert agreed and [int(count) for count in agreed.groups()] == [8, 8, 8], out


def test_the_decode_part_warms_every_timed_length_before_timing(monkeypatch, capsys):
    """Claim (bench.py gpu --parts decode): each side is called once at every length it is timed at (1, M/2 and M new
    tokens) before its first timed call, since a compiled step's first call at a new cache length compiles again and,
    timed, would count as decoding; each round's decode figure is printed, and kept beside the median."""
    import argparse

    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks import gpu
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1))
    calls: list[int] = []
    monkeypatch.setattr(gpu, "decode_workload", lambda args, device: (model, [[1, 2, 3], [4, 5]]))
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(gpu, "decode_sides", lambda *args: {"side": calls.append})
    parser = argparse.ArgumentParser()
    gpu.gpu_args(parser)
    args = parser.parse_args(["--device", "cpu", "--vocab", "32", "--decode-tokens", "6", "--rounds", "2"])
    figures = gpu.decode_part(args, torch.device("cpu"))
    assert calls == [1, 3, 6] * 3  # the untimed calls first, then two timed rounds
    each = figures["sides"]["side"]["decode_ms_each_round"]
    out = capsys.readouterr().out
    assert len(each) == 2 and all(f"round {r}: side" in out for r in (0, 1)), out


def test_the_benchmarks_tail_cuts_each_row_at_its_drawn_length():
    """Claim (benchmarks/tail.py): with the tail on, row i of prompt j ends at L = tail_length((seed, k, j), i, M)
    tokens, its last one a stop id, its first L - 1 those it draws without the tail, unless it stopped on its own
    before L (then it is unchanged); the lengths spread (a tail, not one value); off, the engine is untouched. The
    cut depends on the key alone: a call of one prompt cuts that prompt's rows as a call of two does."""
    import engine
    from benchmarks import tail
    from benchmarks.engine_cpu import eos_ids, qwen_wide_model
    model, stops, cap = qwen_wide_model(1, 256), eos_ids(256), 24
    prompts, keys = [[5, 6, 7], [8, 9]], [(0, 3, 0), (0, 3, 1)]

    def sample(on, count=2):
        with tail.enabled(on):
            return engine.sample_groups(model, prompts[:count], 8, max_new_tokens=cap, stop_ids=[stops[0]],
                                        keys=keys[:count], temperature=1.0)
    natural, cut = sample(False), sample(True)
    assert sum(len(r) == cap for group in natural for r in group) > 8  # most rows run to the cap untailed
    for j, group in enumerate(cut):
        for i, response in enumerate(group):
            drawn, own = tail.tail_length(keys[j], i, cap), natural[j][i]
            if drawn < len(own):
                assert response == own[:drawn - 1] + [stops[0]]
            else:
                assert response == own
    assert len({len(r) for group in cut for r in group}) > 3
    assert sample(True, count=1)[0] == cut[0]
    assert not tail.is_on()


@pytest.mark.slow
def test_the_tail_reaches_the_inference_process(tiny_model_dir, tmp_path, capsys):
    """Claim: `python -m benchmarks.tail trainer.py ...` cuts the rows in async mode's spawned inference process as
    in sync mode's own: the two runs log the same (shorter) response lengths and losses, bitwise as without it. The
    sync runs, which start no process, are trainer.main in this process, with the tail on (tail.enabled) and off."""
    import json
    import subprocess
    import sys

    import trainer
    from benchmarks import tail
    root = Path(__file__).resolve().parents[2]

    def run(mode, launched=False, tailed=True):
        out = tmp_path / f"{mode}{tailed}"
        argv = ["--model", str(tiny_model_dir), "--data", "arithmetic", "--mode", mode, "--rollout-threads", "1",
                "--train-threads", "1", "--iterations", "2", "--eval-every", "0", "--no-save", "--max-new-tokens", "16",
                "--sizes", "rule", "--out", str(out)]
        if launched:
            subprocess.run([sys.executable, "-m", "benchmarks.tail", "trainer.py", *argv], cwd=root, check=True,
                           capture_output=True)
        else:
            with tail.enabled(tailed):
                assert trainer.main(argv) == 0, capsys.readouterr().err
        return [(row["completions/mean_length"], row["loss"]) for row in map(json.loads, open(out / "metrics.jsonl"))
                if not row.get("final")]
    tailed = run("async", launched=True)
    assert tailed == run("sync")
    assert all(cut < whole for (cut, _), (whole, _) in zip(tailed, run("sync", tailed=False)))


def test_train_flops_count_the_mask_pairs_and_the_weights():
    """Claim (bench.py gpu --parts train): one forward's FLOPs are 2·(the decoder's matrix weights)·(packed tokens),
    4·layers·heads·head_dim per (query, key) pair the shared-prompt mask allows (counted here from the mask itself),
    and 2·hidden·vocab per response token (the head at the trained positions only)."""
    from attention import pack, shared_prompt_mask
    from benchmarks.engine_cpu import qwen_wide_model
    from benchmarks.train_step import forward_flops

    model = qwen_wide_model(layers=2, vocab=512)
    groups = [(torch.arange(5), [torch.arange(3), torch.arange(1), torch.arange(4)]),
              (torch.arange(2), [torch.arange(2)])]
    segments = pack(groups).segment_ids  # (2, 13): the second row has 9 padding tokens, each seeing itself
    pairs = int(shared_prompt_mask(segments).sum()) - int((segments < 0).sum())
    weights = 2 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864)  # q, o; k, v (2 of 14 heads); gate, up, down
    expected = 2 * weights * 17 + 4 * 2 * 14 * 64 * pairs + 2 * 896 * 512 * 10
    assert forward_flops(model, [(5, [3, 1, 4]), (2, [2])]) == expected


def test_gpu_train_part_times_every_phase_on_cpu(tmp_path, monkeypatch):
    """Claim (bench.py gpu --parts train): the training part runs on CPU at a tiny size, micro-batch by micro-batch,
    and reports every phase's seconds, the TFLOP/s of those with FLOPs (no share of a peak on CPU), and an iteration
    whose seconds are its phases' without the old policy's; with the logit blocks it used and the memory fit a run
    would make (none on CPU), and with --train-micro-groups 0 it trains as many groups per micro-batch as that fit
    allows. Timings are not asserted, only that they were taken."""
    import argparse
    import json

    from attention import LOGITS_CHUNK_BYTES
    from benchmarks.memory import LiveTensorBytes
    from benchmarks.train_step import PHASES, train_part
    from counting_backend import CountingBackend
    from launch import memory

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"What is {a} + 2?", "answer": "#### 0"})
                                                  + "\n" for a in range(3)))
    args = argparse.Namespace(layers=1, vocab=512, prompts=3, group_size=2, decode_tokens=4, rounds=1,
                              train_micro_groups=2, train_compile="off", data=tmp_path)
    figures = train_part(args, torch.device("cpu"))
    phases = figures["phases"]
    assert list(phases) == list(PHASES) and all(phases[name]["seconds"] >= 0 for name in PHASES if name != "host gaps")
    assert all(phases[name]["tflops"] > 0 and phases[name]["of_peak"] is None
               for name in ("reference", "old policy", "forward", "backward"))
    assert phases["backward"]["flops"] == 2 * phases["forward"]["flops"] == 2 * figures["forward_flops"]
    timed = sum(phases[name]["seconds"] for name in PHASES if name != "old policy")
    assert figures["iteration"]["seconds"] == pytest.approx(timed)
    assert figures["peak_memory_bytes"] > 0
    assert figures["logits_chunk_bytes"] == LOGITS_CHUNK_BYTES and figures["memory_fit"].endswith("no free memory")
    # --train-micro-groups 0: as many groups as the run's memory fit allows, here on memory counted as CUDA counts it
    with LiveTensorBytes() as live:
        monkeypatch.setattr(memory, "device_memory", lambda device: CountingBackend(live, 10**9))
        fitted = train_part(argparse.Namespace(**{**vars(args), "train_micro_groups": 0}), torch.device("cpu"))
    group_tokens = fitted["micro_tokens"] // fitted["micro_groups"]
    assert "GB free for training on cpu" in fitted["memory_fit"] and fitted["fitted_tokens"] > 3 * group_tokens
    assert fitted["micro_groups"] == max(1, min(3, fitted["fitted_tokens"] // group_tokens))


@pytest.mark.slow
def test_gpu_check_script_dry_runs_on_cpu(tmp_path):
    """Claim (tools/gpu_check.sh): the prepared GPU check runs each part it is given under its own limit and leaves
    its log, its figures and its exit status under $OUT; GPU_CHECK_CPU=1 runs the same parts at a tiny size on CPU
    (the train part eager and compiled, side by side); an unknown part is one line and exit 2."""
    import json
    import os
    import subprocess
    import sys

    data = tmp_path / "gsm8k"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"question": f"What is {a} + 2?", "answer": f"#### {a + 2}"})
                                              + "\n" for a in range(4)))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_CPU": "1", "DATA": str(data), "PYTHON": sys.executable}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", "tools/gpu_check.sh", "train", "train-fit"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + (out / "train.log").read_text()[-2000:]
    for part in ("train", "train-fit"):
        assert (out / f"{part}.status").read_text().split()[0] == "0"
        assert set(json.loads((out / f"{part}.json").read_text())["train"]["phases"]) >= {"forward", "backward"}
    fit = json.loads((out / "train-fit.json").read_text())["train"]  # CPU: no memory to fit, one group at a time
    assert fit["micro_groups"] == 1 and fit["memory_fit"] == "micro-batch: cpu reports no free memory"
    train = json.loads((out / "train.json").read_text())["train"]
    assert set(train["sides"]) == {"eager", "compiled"}
    assert train["sides"]["compiled"]["compiled_graphs"] >= 1 and train["sides"]["eager"]["compiled_graphs"] == 0
    wrong = subprocess.run(["bash", "tools/gpu_check.sh", "trian"], cwd=root, env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stdout.strip() == "error: unknown part trian (train, train-fit, decode, " \
                                                             "peer, pipeline, kernels)"


@pytest.mark.parametrize("argv, said", [
    (["publish", "--repeats", "0"], "bench.py publish: error: argument --repeats: must be at least 1 (got 0)"),
    (["shared-prompt", "--threads", "0"], "bench.py shared-prompt: error: argument --threads: must be at least 1"),
    (["memory", "--group-size", "-1"], "bench.py memory: error: argument --group-size: must be at least 1 (got -1)"),
    (["gpu", "--vocab", "2"], "bench.py gpu: error: argument --vocab: must be at least 3 (got 2)"),
    (["publish", "--json", "FILE/out.json"], "bench.py publish: error: --json FILE/out.json: its folder "),
    (["gpu", "--train-micro-groups", "0"], None),  # 0: fitted to memory
])
def test_bench_options_that_cannot_run_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, argv, said):
    """Claim: bench.py refuses a count below its minimum (1, or 0 where 0 chooses) and a --json whose folder is not
    one in one line, exit 2, before it measures anything: a --json that cannot be written does not cost the run."""
    import bench
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a folder")
    ran = []

    def run(args):
        """Records that the benchmark ran."""
        return ran.append(args) or True
    monkeypatch.setitem(bench.BENCHMARKS, argv[0], (bench.BENCHMARKS[argv[0]][0], run))
    try:
        code = bench.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    if said is None:
        assert code == 0 and ran and not err
    else:
        assert code == 2 and not ran and err.startswith(said) and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("raised, code, said", [
    (KeyboardInterrupt(), 130, "interrupted by SIGINT: the benchmark was stopped"),
    (NotADirectoryError(20, "Not a directory", "out/x.json"), 1, "error: out/x.json: Not a directory"),
])
def test_a_benchmark_stopped_or_failing_ends_in_one_line(monkeypatch, capsys, raised, code, said):
    """Claim: Ctrl-C during a benchmark, or a file it cannot write, ends it with one line and its exit code, no
    traceback."""
    import bench

    def fails(args):
        """Raises `raised`."""
        raise raised
    monkeypatch.setitem(bench.BENCHMARKS, "publish", (bench.BENCHMARKS["publish"][0], fails))
    assert bench.main(["publish"]) == code
    err = capsys.readouterr().err
    assert err.startswith(said) and len(err.splitlines()) == 1, err
