"""The command line: --help documents every Config field; bad values fail at start-up with one line, exit 2."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import Config
from infra import console
from infra.options import build_parser, derive, validate
from infra.command_line import parse_args
from launch import run_output
from launch import start as launch_start
import warm

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_field_with_its_default():
    """Every dataclass field is an option with a help line and its default."""
    text = build_parser().format_help()
    for f in dataclasses.fields(Config):
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 8)" in text  # --group-size
    for everyday in ["--model", "--data", "--iterations", "--seed", "--out", "--mode", "--group-size", "--lr",
                     "--beta", "--max-new-tokens", "--device"]:
        assert everyday in text


@pytest.mark.parametrize("argv, fragment", [
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--batch-size", "20", "--group-size", "8"], "multiple of --group-size"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--mode", "fast"], "invalid choice"),
    (["--loss-type", "ppo"], "invalid choice"),
    (["--data", "no/such/file.jsonl"], "neither 'arithmetic'"),
    (["--device", "tpu"], "--device must be auto, cpu"),
    (["--train-device", "cuda:x"], "--train-device must be cpu"),
    (["--updates-per-iteration", "3"], "must divide the prompts per iteration"),
    (["--iterations", "two"], "invalid int value"),
    (["--updates-per-iteration", "0"], "--updates-per-iteration must be at least 1"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--beta", "nan"], "--beta must be a finite number"),
    (["--seed", "1e20"], "invalid int value"),
    (["--seed", str(2**64)], "--seed must be from 0 to 2**64 - 1"),
    (["--seed", "-1"], "--seed must be from 0 to 2**64 - 1"),
    (["--device", "cpu:abc"], "--device must be auto, cpu"),
    (["--dtype", "float16"], "float16 is not supported: training in float16 needs loss scaling"),
    (["--attn_implementation", "flash_attention_2"], "flash_attention_2 cannot take the masks this trainer needs"),
    (["--reward-timeout", "-1"], "--reward-timeout must be >= 0"),
    (["--reward", "math", "--reward", "math-verify", "--reward-weights", "1"],
     "--reward-weights has 1 number(s) but --reward names 2 function(s) (math math-verify): give one weight per reward"),
    (["--reward-weights", "1", "nan"], "--reward-weights has 2 number(s) but --reward names 1 function(s)"),
    (["--reward", "math", "math-verify", "--reward-weights", "1", "inf"], "--reward-weights must be finite numbers"),
    (["--pad-to-multiple-of", "0"], "must be auto, none or a whole number of at least 1 (got 0)"),
    (["--pad-to-multiple-of", "some"], "must be auto, none or a whole number of at least 1 (got some)"),
])
def test_invalid_values_fail_with_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("option", ["--rollout-threads", "--train-threads"])
def test_thread_counts_are_bounded_by_the_cores(option, capsys, monkeypatch):
    """Claim: a thread count above the cores this process may use fails at start-up naming that number (10000
    threads once made a 2-core machine unusable for minutes), while every count up to it is accepted."""
    from infra import options
    monkeypatch.setattr(options, "available_cores", lambda: 4)
    assert getattr(parse_args([option, "4"]), option[2:].replace("-", "_")) == 4
    with pytest.raises(SystemExit) as exit_info:
        parse_args([option, "10000"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{option} must be from 1 to 4, the CPU cores" in err and err.count("\n") == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_threads_follow_the_cores_this_process_may_use(mode, monkeypatch):
    """Claim: under a CPU-affinity limit (a container's share, `taskset`, a Slurm allocation) the default thread
    counts come from the cores this process may run on, not the host's count: 2 allowed cores on a 64-core host
    give at most 2 threads per side, and a run's own printed sizes pass its validation (before, derive and the
    probe used os.cpu_count(): 32 + 32 threads on 2 cores, which the --rollout-threads check then refused)."""
    import os

    from launch import setup
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = parse_args(["--mode", mode, "--sizes", "rule", "--device", "cpu"])
    assert 1 <= cfg.rollout_threads <= 2 and 1 <= cfg.train_threads <= 2, cfg
    assert cfg.train_threads_after_sampling <= 2, cfg
    again = parse_args(["--mode", mode, "--sizes", "rule", "--device", "cpu", "--rollout-threads",
                        str(cfg.rollout_threads), "--train-threads", str(cfg.train_threads)])
    assert (again.rollout_threads, again.train_threads) == (cfg.rollout_threads, cfg.train_threads)
    assert setup.oversubscribed(cfg) == (cfg.rollout_threads + cfg.train_threads > 2)  # 2 cores, not 64


def test_every_accepted_seed_seeds_torch():
    """Claim: every seed --seed accepts (up to 2**64 - 1) seeds torch's generators (the per-prompt seeds are folded
    into 64 bits; unfolded, a seed of 2e7 already overflowed), and the fold changes no seed torch took before: small
    seeds are unchanged, and the held-out evaluation's negative ones draw the same numbers folded."""
    import torch

    from rollout import iteration_prompts, prompt_seed
    assert prompt_seed(7, 3, 2) == (7 * 1_000_003 + 3) * 1_000_003 + 3
    unfolded = (0 * 1_000_003 - 1) * 1_000_003 + 1  # seed 0, iteration -1 (evaluation), prompt 0: negative
    draws = [torch.rand(3, generator=torch.Generator().manual_seed(s)) for s in (unfolded, prompt_seed(0, -1, 0))]
    assert torch.equal(*draws)
    for seed in (20240101, 2**63, 2**64 - 1):
        torch.manual_seed(prompt_seed(seed, 5, 3))
        torch.manual_seed(prompt_seed(seed, -1, 0))
        assert len(iteration_prompts(100, 4, seed, 7)) == 4



def test_iteration_prompts_are_consecutive_slices_of_each_epochs_permutation():
    """Claim: iterations take consecutive slices of one seeded permutation per epoch (torch.randperm seeded by
    seed·7919 + epoch), across epoch boundaries and when one iteration spans several epochs: every epoch visits
    every example once, and the indices are the definition's, position by position."""
    import torch

    from rollout import iteration_prompts

    def definition(n, per, seed, k):
        return [int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + p // n))[p % n])
                for p in range(k * per, (k + 1) * per)]
    for n, per in ((10, 4), (3, 7), (5, 5)):
        taken = [i for k in range(6) for i in iteration_prompts(n, per, 11, k)]
        assert taken == [i for k in range(6) for i in definition(n, per, 11, k)]
        epochs = [sorted(taken[e * n:(e + 1) * n]) for e in range(len(taken) // n)]
        assert all(epoch == list(range(n)) for epoch in epochs)

def test_defaults_are_valid_and_derived():
    cfg = parse_args([])
    assert validate(cfg) == [] and cfg.max_new_tokens == 8 and cfg.lr > 0 and cfg.mode == "async"
    real = derive(Config(model="qwen2.5-0.5b"))
    assert real.max_new_tokens == 512 and real.lr == 1e-6
    assert derive(Config(mode="sync", rollout_threads=None)).train_threads >= 1
    assert derive(Config(model="tiny-chain")).max_new_tokens == 128 and Config(model="tiny-chain").default_data == "chain"


def test_thread_split(monkeypatch):
    """Claim (--sizes rule): async splits the cores between the two processes, except when an iteration is one generate call
    (the sides then sample then train, so each gets all cores); sync uses all of them; explicit counts win."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    split = derive(Config(mode="async", sizes="rule"))
    assert (split.rollout_threads, split.train_threads) == (4, 4)
    turns = derive(Config(mode="async", batch_size=64, group_size=8, groups_per_call=8, sizes="rule"))
    assert turns.calls_per_iteration == 1 and (turns.rollout_threads, turns.train_threads) == (8, 8)
    assert derive(Config(mode="async", batch_size=64, group_size=8, groups_per_call=3)).calls_per_iteration == 3
    assert derive(Config(mode="sync", sizes="rule")).train_threads == 8
    assert derive(Config(mode="async", rollout_threads=2, sizes="rule")).train_threads == 6


def test_probed_sizes_are_left_open_on_cpu_only(monkeypatch):
    """Claim: with --sizes probe (the default) on CPU, derive leaves exactly the sizes not given open for the probe
    (sync: only the generate calls; its threads are all cores); on an accelerator the rule fills them but the
    micro-batch, left to the memory fit (launch/memory.py; --sizes rule fills it too)."""
    from infra import options
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cpu")
    probed = derive(Config(mode="async"))
    assert (probed.groups_per_call, probed.rollout_threads, probed.train_threads) == (None, None, None)
    assert not probed.sized and derive(Config(mode="async", groups_per_call=4, rollout_threads=2)).train_threads is None
    sync = derive(Config(mode="sync"))
    assert (sync.groups_per_call, sync.rollout_threads, sync.train_threads) == (None, 8, 8)
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cuda")
    monkeypatch.setattr(options, "accelerator_count", lambda _: 1)
    accelerated = derive(Config(mode="async"))
    assert accelerated.micro_batch_tokens is None and options.fits_memory(accelerated)
    assert derive(Config(mode="async", sizes="rule")).sized


def test_trainer_cli_bad_value_exits_2_without_traceback():
    """The real entry point, in a subprocess: one line on stderr, exit code 2, no traceback."""
    result = warm.run([sys.executable, "trainer.py", "--group-size", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0


@pytest.mark.slow
@pytest.mark.parametrize("given, expected", [({}, "30000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                             ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_trainer_shortens_openmp_spinning_before_torch_loads(given, expected, tmp_path):
    """The entry point sets GOMP_SPINCOUNT before torch (and its libgomp, which reads it once) is imported, so the
    inference processes inherit it too; a user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is."""
    probe = ("import os, sys, trainer\n"
             "assert 'torch' not in sys.modules\n"
             "real_import = __builtins__.__import__\n"
             "def spy(name, *args, **kwargs):\n"
             "    if name == 'torch' and 'torch' not in sys.modules:\n"
             "        print('at torch import:', os.environ.get('GOMP_SPINCOUNT'))\n"
             "    return real_import(name, *args, **kwargs)\n"
             "__builtins__.__import__ = spy\n"
             f"trainer.main(['--model', 'periodic-rl-tests/no-such-model', '--out', {str(tmp_path)!r}])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | given
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.splitlines()[0] == f"at torch import: {expected}", result.stdout + result.stderr


def test_device_auto_picks_the_hardware(monkeypatch):
    """Claim: --device auto (the default) samples on cuda:0 and trains on cuda:1 with two or more GPUs, both on cuda:0
    with one, NPUs the same way, else the CPU; sync mode (one process) uses the first device; --dtype auto is
    bf16 on accelerators that support it and float32 on CPU; an iteration is one generate call on accelerators,
    two on CPU."""
    from infra import options
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cpu")  # whatever this machine has
    assert options.pick_devices("auto", "async") == ("cpu", "cpu") and derive(Config()).dtype == "float32"
    for kind, count, expected in [("cuda", 4, ("cuda:0", "cuda:1")), ("cuda", 1, ("cuda:0", "cuda:0")),
                                  ("npu", 2, ("npu:0", "npu:1"))]:
        monkeypatch.setattr(options, "detect_accelerator", lambda: kind)
        monkeypatch.setattr(options, "accelerator_count", lambda _: count)
        assert options.pick_devices("auto", "async") == expected
        assert options.pick_devices("auto", "sync") == (expected[0], expected[0])
    assert derive(Config(device="auto")).calls_per_iteration == options.GENERATE_CALLS["accelerator"] == 1
    assert derive(Config(device="auto", groups_per_call=2)).groups_per_call == 2
    assert derive(Config(device="auto", rollout_device="npu:3")).rollout_device == "npu:3"
    assert options.pick_dtype("auto", "npu:1") == "bfloat16" and options.pick_dtype("float32", "npu:1") == "float32"
    assert options.pick_dtype("auto", "cpu") == "float32"
    assert derive(Config(device="cpu", sizes="rule")).calls_per_iteration == options.GENERATE_CALLS["cpu"] == 2


def test_missing_device_is_one_line(monkeypatch):
    """Claim: a device that does not exist fails at start-up with one line naming the option and what exists
    (cuda:7 on a one-GPU machine), not a crash later; without CUDA, the line says so."""
    import torch

    if torch.cuda.is_available():
        with pytest.raises(launch_start.DeviceError, match="this machine has"):
            launch_start.check_device(f"cuda:{torch.cuda.device_count()}", "--train-device")
    else:
        with pytest.raises(launch_start.DeviceError, match="--train-device cuda:0: this torch build sees no CUDA GPU"):
            launch_start.check_device("cuda:0", "--train-device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(launch_start.DeviceError, match=r"--rollout-device cuda:7: this machine has 1 cuda device\(s\)"):
        launch_start.check_device("cuda:7", "--rollout-device")
    launch_start.check_device("cuda:0")
    launch_start.check_device("cpu")


def test_readme_real_model_command_is_valid(monkeypatch):
    """Claim: the README's real-model command uses options as they are: it parses and validates (the data path is
    taken as present), and gives the defaults the README says it does on this machine's kind of hardware."""
    import re
    import shlex
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "--model qwen2.5-0.5b" in b)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["python", "trainer.py"]
    monkeypatch.setattr("os.path.isfile", lambda path: True)
    cfg = parse_args(argv[2:])
    assert cfg.model == "qwen2.5-0.5b" and cfg.gradient_checkpointing and cfg.max_new_tokens == 512
    assert cfg.lr == 1e-6 and cfg.device == "auto"


def test_loss_types_are_the_losses():
    """Claim: the command line offers exactly the losses grpo.py implements (config repeats the list so that parsing
    options does not import torch)."""
    import grpo
    from config import LOSS_TYPES
    assert LOSS_TYPES == grpo.LOSS_TYPES


# --- TRL's names and defaults ---
# TRL 1.16's defaults (trl/trainer/grpo_config.py; transformers 5's TrainingArguments under it for seed,
# max_grad_norm, weight_decay, report_to, save_total_limit, lr_scheduler_type; TRL's _BaseConfig for
# gradient_checkpointing), read from the released wheel trl-1.16.0
TRL_DEFAULTS = {"num_generations": 8, "learning_rate": 1e-6, "max_completion_length": 512, "temperature": 1.0,
                "top_p": 1.0, "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2, "loss_type": "dapo",
                "scale_rewards": "group", "use_bias_correction_kl": True, "mask_truncated_completions": False,
                "num_iterations": 1, "max_grad_norm": 1.0, "weight_decay": 0.0, "seed": 42, "report_to": ["none"],
                "save_total_limit": 0, "gradient_checkpointing": True, "reward_weights": [1.0],
                "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "disable_dropout": False,
                "num_completions_to_print": None,
                "pad_to_multiple_of": 1}  # None read as ours: keep all = 0, weights 1 each; "auto" on CPU: no padding


def test_pad_to_multiple_of_reads_trls_values_and_pads_on_accelerators_only(monkeypatch, tmp_path):
    """Claim: --pad-to-multiple-of takes TRL's values (auto, none or null = no padding, N; a TRL YAML's null is no
    padding too); auto derives 1 (none) with both sides on CPU and 128 with either on a GPU, and a run record's value
    is re-derived when the device is given anew."""
    from infra import command_line, options
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cpu")
    assert parse_args([]).pad_to_multiple_of == 1
    assert [parse_args(["--pad-to-multiple-of", value]).pad_to_multiple_of for value in ("none", "Null", "64")] \
        == [1, 1, 64]
    (tmp_path / "trl.yaml").write_text("pad_to_multiple_of: null\nlearning_rate: 1.0e-5\n")
    assert command_line.file_arguments(str(tmp_path / "trl.yaml")) == ["--pad-to-multiple-of=none", "--lr=1e-05"]
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cuda")
    monkeypatch.setattr(options, "accelerator_count", lambda _: 1)
    assert derive(Config()).pad_to_multiple_of == 128 and derive(Config(pad_to_multiple_of=8)).pad_to_multiple_of == 8
    assert derive(Config(device="cpu")).pad_to_multiple_of == 1
    assert derive(Config(device="cpu", train_device="cuda:0")).pad_to_multiple_of == 128  # either side on a GPU
    assert "pad_to_multiple_of" in command_line.DERIVED_FROM["device"]


def test_our_defaults_are_trls_but_the_listed_departures():
    """Claim: every option that TRL 1.16's GRPOConfig also has (under its name or an alias) defaults to TRL's value
    for a real model, unless --help's and the README's list of departures names it with its reason; and every
    departure listed is one (its option exists, and the README lists it too)."""
    from infra.trl_names import DEPARTURES, TRL_ALIASES
    real = parse_args(["--model", "qwen2.5-0.5b"])
    listed = {option for option, *_ in DEPARTURES}
    readme = (ROOT / "README.md").read_text()
    differ = []
    for trl, theirs in TRL_DEFAULTS.items():
        name = "epsilon_low" if trl == "epsilon" else TRL_ALIASES.get(trl, trl)
        ours = getattr(real, name)
        if ours != theirs and "--" + name.replace("_", "-") not in listed:
            differ.append((trl, ours, theirs))
    assert not differ, f"defaults that differ from TRL 1.16's and are not in infra/trl_names.DEPARTURES: {differ}"
    options = {action.option_strings[0] for action in build_parser()._actions if action.option_strings}
    for option, ours, theirs, why in DEPARTURES:
        assert option in options or option == "log", option
        assert f"`{option}" in readme or option == "log" and "every iteration" in readme, f"README lacks {option}"


def test_trl_names_are_aliases_of_ours(tmp_path):
    """Claim: TRL's names for our options work on the command line (with - or _) and as --config keys (JSON or YAML),
    each meaning the same as ours; --epsilon sets both clip ranges unless --epsilon-high is given, in either order
    (TRL: epsilon_high None = epsilon); --help shows each under our name, saying TRL's."""
    from infra.command_line import given_options
    cfg = parse_args(["--num-generations", "4", "--batch-size", "16", "--learning_rate", "3e-5",
                      "--max-completion-length", "64", "--no-use-bias-correction-kl", "--output-dir", "somewhere",
                      "--save-total-limit", "5"])
    assert (cfg.group_size, cfg.lr, cfg.max_new_tokens, cfg.kl_bias_correction, cfg.out, cfg.keep_checkpoints) == \
        (4, 3e-5, 64, False, "somewhere", 5)
    assert {"group_size", "lr", "max_new_tokens", "out"} <= given_options(["--num-generations", "4", "--batch-size",
                                                                            "16", "--lr=1", "--output_dir", "x",
                                                                            "--max-completion-length", "3"])
    for argv, ranges in [(["--epsilon", "0.1"], (0.1, 0.1)),
                         (["--epsilon", "0.1", "--epsilon-high", "0.3"], (0.1, 0.3)),
                         (["--epsilon-high", "0.3", "--epsilon", "0.1"], (0.1, 0.3))]:
        cfg = parse_args(argv)
        assert (cfg.epsilon_low, cfg.epsilon_high) == ranges, argv
    path = tmp_path / "grpo.yaml"
    path.write_text("num_generations: 4\nbatch_size: 16\nlearning_rate: 2.0e-5\nmax_completion_length: 32\n"
                    "epsilon_high: 0.28\nepsilon: 0.1\nsave_total_limit: null\noutput_dir: trl_out\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.group_size, cfg.lr, cfg.max_new_tokens, cfg.epsilon_low, cfg.epsilon_high, cfg.keep_checkpoints,
            cfg.out) == (4, 2e-5, 32, 0.1, 0.28, 0, "trl_out")
    assert parse_args(["--config", str(path), "--epsilon", "0.2"]).epsilon_high == 0.2  # given anew: both ranges
    text = " ".join(build_parser().format_help().split())
    assert "--group-size GROUP_SIZE" in text and "(TRL: --num-generations)" in text
    assert "--num-generations GROUP_SIZE" not in text  # one name per option in the list


@pytest.mark.parametrize("old, new", [("groups_per_chunk", "groups_per_call"),
                                      ("tail_threads", "train_threads_after_sampling")])
def test_an_old_option_name_is_read_as_the_new_one(tmp_path, monkeypatch, old, new):
    """Claim: an option's old name (--groups-per-chunk for --groups-per-call, --tail-threads for
    --train-threads-after-sampling), typed (with - or _) or as a key of a --config file (a config.json written
    before the rename), sets the new one; --help lists the new name only."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))  # thread counts up to 2 are valid
    flag, old_flag = "--" + new.replace("_", "-"), "--" + old.replace("_", "-")
    assert getattr(parse_args([old_flag, "2"]), new) == 2
    assert getattr(parse_args([f"--{old}=1"]), new) == 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps({old: 2, "iterations": 3}))
    assert getattr(parse_args(["--config", str(path)]), new) == 2
    assert getattr(parse_args(["--config", str(path), flag, "1"]), new) == 1  # typed wins
    text = build_parser().format_help()
    assert flag in text and old_flag not in text


@pytest.mark.parametrize("argv, message", [
    (["--num_generations_eval", "4"], "--num-generations-eval is TRL's and means something else here; use "
                                      "--eval-samples"),
    (["--num-iterationz", "2"], "unrecognized option --num-iterationz: did you mean --num-iterations?"),
    (["--iteration", "3"], "unrecognized option --iteration: did you mean --iterations?"),
    (["--iter", "3"], "unrecognized option --iter"),  # an abbreviation is not expanded
    (["--zzzz"], "unrecognized option --zzzz (see --help)"),
])
def test_an_unknown_option_says_which_one_to_use(argv, message, capsys):
    """Claim: a TRL option whose meaning differs here names ours and why, any other unknown option gets difflib's
    closest name, in one line with exit code 2 (not argparse's bare "unrecognized arguments"); abbreviations are off,
    so TRL's --epsilon is never "ambiguous" (it is an option of its own)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err
    assert parse_args(["--epsilon", "0.3"]).epsilon_low == 0.3


def test_every_trl_name_refused_or_ignored_is_none_of_ours():
    """Claim: each TRL name that is refused (TRL_DIFFERENT) or ignored in a --config file (TRL_UNUSED) is neither one
    of our options nor an alias of one: such an entry could never be reached (TRL_DIFFERENT["top_k"] said --top-k did
    not exist, after it did), and a name is refused or ignored, not both."""
    import dataclasses

    from infra.trl_names import TRL_ALIASES, TRL_DIFFERENT, TRL_FIXED, TRL_UNUSED
    ours = {f.name for f in dataclasses.fields(Config)} | set(TRL_ALIASES) | {"epsilon"}
    assert not (set(TRL_DIFFERENT) | set(TRL_UNUSED) | set(TRL_FIXED)) & ours
    assert not set(TRL_DIFFERENT) & set(TRL_UNUSED) and not (set(TRL_DIFFERENT) | set(TRL_UNUSED)) & set(TRL_FIXED)


def test_help_explains_the_log_columns_and_the_departures():
    """Claim: --help ends with one line per column of the log (each a column format_row prints) and the defaults
    that are not TRL's, each with its reason."""
    from infra.trl_names import DEPARTURES, LOG_COLUMNS
    text = build_parser().format_help()
    row = console.format_row({"iteration": 3, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward": None, "kl": 0.01,
                              "clip_fraction": 0.0, "response_length": 4.0, "generate_s": 1.0, "eval_s": 2.0,
                              "train_s": 0.5, "idle_inference_s": 0.1, "idle_training_s": 0.6, "overlap": 0.5,
                              "tokens_per_s": 100})
    for column, meaning in LOG_COLUMNS:
        assert f"  {column}  " in text and meaning.split()[0] in text
        assert all(part.split()[0].rstrip(",") in row for part in column.split(", ")), (column, row)
    for option, ours, theirs, why in DEPARTURES:
        assert f"  {option} {ours} (TRL: {theirs}): " in text.replace("\n    ", " ")


def test_the_final_line_is_left_out_without_an_evaluation():
    """Claim: with evaluation off the final row prints nothing ("final held-out reward -" said
    nothing); with it, the held-out reward of θ_final."""
    assert console.format_row({"final": True, "eval_reward": None, "policy_version": 4}) == ""
    assert console.format_row({"final": True, "eval_reward": 0.5, "policy_version": 4}) == \
        "final  held-out reward 0.500 (θ_4)"


def test_off_a_terminal_progress_is_a_line():
    """Claim: the progress bar's content as one line (for logs that are no terminal): iterations done,
    the time so far and the time left at the measured pace."""
    assert console.progress_line(12, 60, 41.0, 3.4) == \
        "periodic-rl: progress 12/60 iterations, 00:41 elapsed, ~02:43 left"


@pytest.mark.parametrize("devices, said", [(("cpu", "cpu"), False), (("cuda:0", "cuda:1"), True),
                                           (("npu:0,npu:1", "cpu"), True)])
def test_the_device_split_line_is_printed_only_where_a_side_has_a_device(devices, said, tmp_path, capsys):
    """Claim: the closing line on the split of devices between the two sides is printed only when a
    side runs on a GPU or NPU; on CPU cores there is no device to move."""
    cfg = Config(out=str(tmp_path), iterations=2, save=False, eval_every=0, rollout_device=devices[0],
                 train_device=devices[1])

    def rows():
        for k in range(2):
            yield {"iteration": k, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward": None,
                   "generate_device_s": 2.0, "train_s": 1.0}
        yield {"final": True, "iteration": 2, "eval_reward": None, "policy_version": 2}
    run_output.log_and_save(cfg, rows(), None, None)
    assert ("periodic-rl: split: inference 2.0x slower than training" in capsys.readouterr().out) == said


def test_off_a_terminal_the_log_has_progress_lines(tmp_path, monkeypatch, capsys):
    """Claim: where stderr is no terminal (nohup, CI) the progress bar is replaced by a progress line
    every PROGRESS_EVERY_S (here 0: every iteration after the first, whose row sets the pace's origin), on stderr;
    the log on stdout has no final line when nothing was evaluated."""
    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    cfg = Config(out=str(tmp_path), iterations=3, save=False, eval_every=0)

    def rows():
        for k in range(3):
            yield {"iteration": k, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward": None}
        yield {"final": True, "iteration": 3, "eval_reward": None, "policy_version": 3}
    run_output.log_and_save(cfg, rows(), None, None)
    out, err = capsys.readouterr()
    assert [line.split(",")[0] for line in err.splitlines()] == ["periodic-rl: progress 2/3 iterations",
                                                                "periodic-rl: progress 3/3 iterations"], err
    assert out.count("\niter ") + out.startswith("iter ") == 3 and "final" not in out, out


@pytest.mark.parametrize("earlier", [None, 1000, "before num_tokens", "lost"])
def test_num_tokens_counts_the_runs_tokens_so_far(tmp_path, earlier):
    """Claim: each row's num_tokens is TRL's: the prompt and response tokens of every iteration so far (the learner's
    input_tokens, summed); a resumed run continues the count of the rows it continues, and one that continues
    rows written before num_tokens existed, or whose earlier rows are lost, logs none rather than a count that
    starts over."""
    cfg = Config(out=str(tmp_path), iterations=3, save=False, eval_every=0)
    history = tmp_path / "before.jsonl"
    if earlier is not None and earlier != "lost":
        row = {"iteration": 0, "reward_mean": 0.5, "eval_reward": None}
        history.write_text(json.dumps({**row, "num_tokens": earlier} if earlier == 1000 else row) + "\n")

    def rows():
        for k in range(1 if earlier else 0, 3):
            yield {"iteration": k, "reward_mean": 0.5, "eval_reward": None, "input_tokens": 10 * (k + 1)}
        yield {"final": True, "iteration": 3, "eval_reward": None, "policy_version": 3}
    run_output.log_and_save(cfg, rows(), None, None, resumed_at=1 if earlier else 0, history=history)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("input_tokens" not in row for row in logged)
    expected = {None: [10, 30, 60], 1000: [1000, 1020, 1050], "before num_tokens": [None, None, None],
                "lost": [None, None]}[earlier]
    assert [row.get("num_tokens") for row in logged if not row.get("final")] == expected


def test_responses_no_reward_scored_are_warned_about_once(tmp_path, capsys):
    """Claim: the first iteration with responses that no reward scored (frac_reward_unscored > 0: every --reward
    returned None for them) gets one warning line, as TRL warns; later ones are not repeated (metrics.jsonl has
    each iteration's share). All of them unscored: the line says the step learns nothing from the rewards."""
    cfg = Config(out=str(tmp_path), iterations=4, save=False, eval_every=0)

    def rows():
        for k, share in enumerate([0.0, 1.0, 0.5, 1.0]):
            yield {"iteration": k, "reward_mean": None, "reward_std": None, "eval_reward": None,
                   "frac_reward_unscored": share}
        yield {"final": True, "iteration": 4, "eval_reward": None, "policy_version": 4}
    run_output.log_and_save(cfg, rows(), None, None)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warnings == [console.unscored_line(1, 1.0)], warnings
    assert "100% of the responses" in warnings[0] and "learns nothing from the rewards" in warnings[0]


def test_the_first_line_says_when_the_test_split_is_smaller_than_eval_size():
    """Claim: --eval-size larger than the data's held-out split holds out the whole split, and the run's first line
    says so, naming the split; at or below it, the line only counts the prompts of a
    built-in task, and names the split of a dataset's."""
    from infra import data, tasks
    assert "1319 held-out prompts |" in console.start_line(Config(eval_size=1319), 7473, 1319)
    assert data.held_out_note("test", 1319, 1319) == data.held_out_note("test", 1319, 64) == "held out: the test split"
    notes = (data.held_out_note("test", 100, 500),)
    assert "100 held-out prompts (--eval-size 500: the test split has 100) |" in \
        console.start_line(Config(eval_size=500), 7473, 100, notes)
    held_out = len(tasks.arithmetic_examples("eval"))
    said = data.read_task("arithmetic", eval_size=10_000).notes
    assert said == (f"--eval-size 10000: the eval split has {held_out}",)
    assert data.read_task("arithmetic", eval_size=64).notes == ()  # the built-in task's own split: nothing to say


def test_the_first_line_says_held_out_prompts_are_never_evaluated():
    """Claim: --eval-size given with --eval-every 0 still keeps its prompts out of training (the same training
    prompts as the run that evaluates), and the run's first line says they are never evaluated; with evaluation on, or nothing held out, it says nothing of it."""
    from infra.options import derive
    cfg = derive(Config(eval_every=0, eval_size=50))
    assert cfg.eval_size == 50
    assert "50 held-out prompts (held out, not evaluated: --eval-every 0) |" in console.start_line(cfg, 7423, 50)
    assert "not evaluated" not in console.start_line(derive(Config(eval_size=50)), 7423, 50)
    assert "not evaluated" not in console.start_line(derive(Config(eval_every=0)), 7473, 0)


def test_a_misspelt_model_is_named_before_the_data_is_read(tmp_path):
    """Claim: --model tinyy (or qwen2.5-0.6b) is one line naming the model it misspells, with the options, exit 2,
    before the data is read (the default data of a model that is not tiny is the hub's gsm8k). A
    folder, a hub id (org/name), an alias or a name close to none is left to the loader."""
    from infra.options import misspelt_model
    assert misspelt_model("tinyy") == "tiny" and misspelt_model("qwen2.5-0.6b") == "qwen2.5-0.5b"
    assert misspelt_model("Tiny-Chain") == "tiny-chain"  # the offline names are case-sensitive
    (tmp_path / "tinyy").mkdir()
    assert [misspelt_model(name) for name in ("tiny", "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2",
                                              str(tmp_path / "tinyy"))] == [None] * 5
    result = warm.run([sys.executable, "trainer.py", "--model", "tinyy"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "trainer.py: error: --model tinyy: not a folder, nor a name this trainer knows: did you mean tiny? (a hub id "
        "is org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)"]


def test_a_config_files_value_of_the_wrong_type_names_the_file(tmp_path, capsys):
    """Claim: `iterations: two` in a --config file is one line naming the file and the option, exit 2 (argparse's
    own line named the option alone, as if typed)."""
    from infra.command_line import parse_args
    (tmp_path / "run.yaml").write_text("iterations: two\n")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", str(tmp_path / "run.yaml")])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"trainer.py: error: --config {tmp_path / 'run.yaml'} argument --iterations: invalid int value: 'two'\n")


def test_the_first_line_says_the_engines_one_time_compilation():
    """Claim: where the engine's decode step is compiled (--engine auto with the sampler on CUDA, --engine compile
    anywhere), the run's first line says that its first generate call compiles once and how to skip it; with the
    sampler on CPU under auto, or with --engine eager or hf, it says nothing of compiling."""
    from infra.options import derive
    said = "sampling compiled: each sampler's first generate call compiles one layer and the draw, once"
    assert said in console.start_line(Config(rollout_device="cuda:0"), 10, 0)
    assert said in console.start_line(Config(rollout_device="cpu", engine="compile"), 10, 0)
    for quiet in (derive(Config(device="cpu")), Config(rollout_device="cuda:0", engine="eager"),
                  Config(rollout_device="cuda:0", engine="hf")):
        assert "compil" not in console.start_line(quiet, 10, 0), quiet.engine


def test_the_first_line_says_the_memory_to_expect():
    """Claim: the first line estimates the memory a run needs from the model's parameters (launch/sizing.py's sum:
    float32 masters, gradients and AdamW's moments, the frozen float32 copies, each sampler's copy and the shared
    buffer), said as an estimate; LoRA trains and copies the adapter alone; a toy's few MB are not said."""
    from launch.sizing import memory_estimate
    qwen = 494_032_768  # Qwen2.5-0.5B's parameters
    cfg = Config(model="qwen2.5-0.5b", dtype="float32", out="o")  # on CPU: sampling in float32
    trainer, inference = memory_estimate(cfg, qwen, qwen)
    assert (trainer, inference) == (20 * qwen, 8 * qwen)  # 16 + the reference; one worker + the buffer
    line = console.start_line(cfg, 7000, 64, memory=(trainer, inference))
    assert "| memory ~9.9 GB trainer, ~4.0 GB inference (an estimate from the parameters, activations aside) |" in line
    two_steps = memory_estimate(dataclasses.replace(cfg, updates_per_iteration=2, beta=0.0, mode="sync"), qwen, qwen)
    assert two_steps == (20 * qwen, 4 * qwen)  # the old copy instead of the reference; sync: no buffer
    lora = memory_estimate(Config(dtype="bfloat16", use_peft=True), qwen, 1_000_000)
    assert lora == (4 * qwen + 12 * 1_000_000 + 4 * 1_000_000, 4 * qwen)
    assert "memory" not in console.start_line(cfg, 7000, 64, memory=memory_estimate(cfg, 330_000, 330_000))


def test_a_blank_model_is_one_line(capsys):
    """Claim: `--model ''` (`--model "$MODEL"` with MODEL unset) is refused in one line naming --model, exit 2,
    before any data or model is looked for."""
    for blank in ("", "  "):
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--model", blank])
        assert stopped.value.code == 2
        assert capsys.readouterr().err == (f"trainer.py: error: --model {blank!r} names no model (an unset shell "
                                           "variable?): give 'tiny', an alias such as qwen2.5-0.5b, a hub id or a "
                                           "local directory\n")


def test_dataset_options_with_a_built_in_task_are_said_to_be_ignored(tmp_path, capsys):
    """Claim: the options that choose a dataset's splits and its answer column, given with a built-in task (which has
    none to choose), are named in one line as ignored, as the --lora-* options are without --use-peft; with a data
    file they are used, and nothing is said. --prompt-column is not among them: --text-prompts auto reads it."""
    cfg = parse_args(["--split", "x", "--eval-split", "y"])
    assert cfg.split == "x" and capsys.readouterr().out == (
        "periodic-rl: ignored --eval-split, --split: options of a dataset (a file, a folder or a hub id), and --data "
        "arithmetic is built in\n")
    parse_args(["--prompt-column", "prompt"])  # not ignored: --text-prompts auto reads it (raw text for 'prompt')
    assert capsys.readouterr().out == ""
    parse_args(["--model", "tiny-chain", "--answer-column", "a", "--data-config", "c"])
    assert capsys.readouterr().out.endswith("ignored --answer-column, --data-config: options of a dataset (a file, a "
                                            "folder or a hub id), and --data chain is built in\n")
    (tmp_path / "rows.jsonl").write_text('{"q": "1+1=", "answer": "2"}\n')
    parse_args(["--data", str(tmp_path / "rows.jsonl"), "--prompt-column", "q"])
    assert capsys.readouterr().out == ""
