"""trainer.train: the trainer from Python, as TRL's GRPOTrainer(...).train() is run: reward functions and datasets
given as Python objects, options as keywords (ours or TRL's), the same run as the command line's."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import rewards
import trainer
from faults import as_from_a_terminal, hang_bound
from infra import python_args
from infra.command_line import parse_args
from infra.tasks import arithmetic_examples
import warm

ROOT = Path(__file__).resolve().parents[2]


def test_options_are_keywords_ours_or_trls():
    """Claim: train's keywords are trainer.py's options with _ for -, ours or TRL's (the batch keys, max_steps, a
    flag of no use here such as bf16), booleans as true/false, lists as values, a mapping as JSON: the Config parsed
    from them is the one the typed command line gives."""
    argv = python_args.train_argv("tiny", "math", learning_rate=1e-5, num_generations=4,
                                    per_device_train_batch_size=8, steps_per_generation=2, max_steps=6,
                                    log_completions=True, bf16=True, disable_dropout=False, report_to=["none"],
                                    chat_template_kwargs={"a": 1})
    typed = ["--model", "tiny", "--reward", "math", "--learning-rate", "1e-5", "--num-generations", "4",
             "--per-device-train-batch-size", "8", "--steps-per-generation", "2", "--max-steps", "6",
             "--log-completions", "--bf16", "--no-disable-dropout", "--report-to", "none",
             "--chat-template-kwargs", '{"a": 1}']
    cfg = parse_args(argv)
    assert cfg == parse_args(typed)
    assert (cfg.lr, cfg.group_size, cfg.batch_size, cfg.updates_per_iteration, cfg.iterations, cfg.disable_dropout) \
        == (1e-5, 4, 16, 2, 3, False)


def test_a_reward_function_is_found_by_name_in_every_process():
    """Claim: a reward function given as a Python object becomes the --reward spec the inference process imports it
    by ('module:name'); a str is a spec already; what no other process can find by name (a lambda, a nested
    function, a partial) is refused in one line saying what to give instead."""
    assert python_args.reward_spec(rewards.digit_fraction) == "rewards:digit_fraction"
    assert python_args.train_argv(reward_funcs=[rewards.digit_count, "math"]) == ["--reward", "rewards:digit_count",
                                                                               "math"]

    def nested(prompt, completion, answer):
        return 0.0
    for function in (lambda prompt, completion, answer: 0.0, nested, functools.partial(rewards.digit_fraction)):
        with pytest.raises(ValueError, match=r"give a function \(or a callable object\) defined at the top level"):
            python_args.reward_spec(function)
    with pytest.raises(ValueError, match=r"^train: reward .*: give a function \(or a callable object\) defined"):
        trainer.train("tiny", reward_funcs=nested)


def test_a_dataset_is_written_once_where_every_process_reads_it(tmp_path, monkeypatch):
    """Claim: a datasets.Dataset given in Python is saved once (save_to_disk) under $PERIODIC_RL_CACHE/datasets, in a
    folder named by its fingerprint, which --data reads (load_from_disk gives its rows back); the same data again
    reuses the folder, other data gets another; eval_dataset becomes its test split (the held-out prompts); a str is
    a --data value already; anything else is refused in one line."""
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    rows = [{"question": example.prompt, "answer": example.answer} for example in arithmetic_examples("train")[:8]]
    dataset = datasets.Dataset.from_list(rows)
    folder = Path(python_args.data_folder(dataset))
    assert folder.parent == tmp_path / "datasets" and datasets.load_from_disk(str(folder)).to_list() == rows
    written = folder.stat().st_mtime_ns
    assert python_args.data_folder(datasets.Dataset.from_list(rows)) == str(folder)
    assert folder.stat().st_mtime_ns == written
    assert python_args.data_folder(datasets.Dataset.from_list(rows[:4])) != str(folder)
    both = datasets.load_from_disk(python_args.data_folder(dataset, datasets.Dataset.from_list(rows[:2])))
    assert sorted(both) == ["test", "train"] and both["test"].to_list() == rows[:2]
    assert python_args.data_folder("gsm8k") == "gsm8k"
    assert not list((tmp_path / "datasets").glob("*.partial"))
    with pytest.raises(ValueError, match="train_dataset is a list: give a datasets.Dataset or DatasetDict"):
        python_args.data_folder(rows)


def test_a_copy_cut_short_leaves_nothing_behind(tmp_path, monkeypatch):
    """Claim: a copy into the cache that fails half-way (a full disk, Ctrl-C) removes its half-written folder; one
    whose writer on this host was killed (SIGKILL: NAME.HOST.PID.partial, PID gone) is removed by the next copy; a
    living writer's is left alone, and so is another host's (a cache shared by a run's nodes: its PID means
    nothing here)."""
    import socket
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    cache, host = tmp_path / "datasets", socket.gethostname()
    abandoned = cache / f"0123456789abcdef.{host}.4194305.partial"  # 4194305 > Linux's largest PID (pid_max <= 2**22)
    living = [cache / f"fedcba9876543210.{host}.{os.getpid()}.partial",
              cache / "0123456789abcdef.other-node.cluster.4194305.partial"]
    for folder in (abandoned, *living):
        folder.mkdir(parents=True)
    dataset = datasets.Dataset.from_list([{"question": "1+1", "answer": "2"}])

    def full_disk(self, path, **kwargs):
        Path(path).mkdir()
        (Path(path) / "data.arrow").write_text("half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full_disk)
    with pytest.raises(OSError, match="No space left"):
        python_args.data_folder(dataset)
    assert sorted(path.name for path in cache.iterdir()) == sorted(path.name for path in living)


SCRIPT = '''
import os
import sys
sys.path.insert(0, {root!r})
import datasets
import trainer
from infra import python_args

with open(os.environ["IMPORTS_LOG"], "a") as log:  # once per process that imports this script
    log.write(f"{{os.getpid()}}\\n")


def exact(completions, answer, **kwargs):  # TRL's form: every column by keyword
    return [float(text.strip() == gold) for text, gold in zip(completions, answer)]


if __name__ == "__main__":
    rows = [dict(question=q, answer=a) for q, a in {rows!r}]
    print("OUT", trainer.train("tiny", exact, datasets.Dataset.from_list(rows), **{options!r}))
'''


@pytest.mark.slow  # process-level: two runs of trainer.py, each with its inference process
def test_train_from_a_script_is_the_command_lines_run(tmp_path):
    """Claim: a script that calls trainer.train with its own reward function and a datasets.Dataset, in async mode
    (a spawned inference process, which imports the script by its path under the script's `__main__` guard), makes
    bitwise the run `python trainer.py --reward script.py:exact --data rows.jsonl` makes with the same rows and
    options: the same metrics rows (timings aside) and the same saved policy. The script runs once per process: the
    trainer finds its reward in the running script, not by loading the file a second time."""
    from test_checkpoint import RUN, outcome
    examples = arithmetic_examples("train")[:64]
    options = dict(mode="async", iterations=3, batch_size=16, group_size=4, max_new_tokens=4, eval_every=0,
                   groups_per_call=2, micro_batch_tokens=64, rollout_threads=1, train_threads=1, seed=3)
    assert set(options) - {"mode", "seed"} <= {flag[2:].replace("-", "_") for flag in RUN if flag.startswith("--")}
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(root=str(ROOT), rows=[(e.prompt, e.answer) for e in examples],
                                    options={**options, "out": str(tmp_path / "api")}))
    env = {**os.environ, "IMPORTS_LOG": str(tmp_path / "api.log"), "PERIODIC_RL_CACHE":
           os.environ.get("PERIODIC_RL_CACHE", str(ROOT / ".cache" / "periodic-rl"))}
    done = warm.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and f"OUT {tmp_path / 'api'}" in done.stdout, done.stderr[-2000:]
    assert len((tmp_path / "api.log").read_text().split()) == 2  # the script's process and the inference process
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": e.prompt, "answer": e.answer}) + "\n"
                                                 for e in examples))
    typed = [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]
    env["IMPORTS_LOG"] = str(tmp_path / "cli.log")
    done = warm.run([sys.executable, "trainer.py", "--reward", f"{script}:exact", "--data",
                           str(tmp_path / "rows.jsonl"), "--model", "tiny", *typed, "--out", str(tmp_path / "cli")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (api_rows, api_policy), (cli_rows, cli_policy) = outcome(tmp_path / "api"), outcome(tmp_path / "cli")
    assert api_rows == cli_rows and [row["iteration"] for row in api_rows if not row.get("final")] == [0, 1, 2]
    assert api_policy.keys() == cli_policy.keys() and all(torch.equal(api_policy[k], cli_policy[k])
                                                          for k in api_policy)
    record = json.loads((tmp_path / "api" / "config.json").read_text())
    assert record["reward"] == [f"{script}:exact"] and Path(record["data"]).parent.name == "datasets"


@pytest.mark.slow  # process-level: torchrun, two ranks each with its inference process
def test_train_under_torchrun_runs_once_per_rank_and_returns_the_run_on_rank_0(tiny_model_dir, tmp_path):
    """Claim: a script that calls trainer.train, launched by `torchrun --nproc-per-node 2` (as a TRL script is by
    `accelerate launch`), makes one 2-rank run: each rank's train returns, rank 0 with the run's folder and rank 1
    with None (it writes nothing); the script runs once in each of the four processes (two ranks, two inference
    processes); the dataset is copied into the cache once, whole (the ranks race to write it: one rename wins)."""
    examples = arithmetic_examples("train")[:32]
    options = dict(mode="async", iterations=2, batch_size=16, group_size=4, max_new_tokens=4, eval_every=0,
                   groups_per_call=1, micro_batch_tokens=64, rollout_threads=1, train_threads=1)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(root=str(ROOT), rows=[(e.prompt, e.answer) for e in examples],
                                    options={**options, "out": str(tmp_path / "ranks")})
                      .replace('trainer.train("tiny"', f"trainer.train({str(tiny_model_dir)!r}"))
    env = {**os.environ, "IMPORTS_LOG": str(tmp_path / "imports.log"), "PERIODIC_RL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("OUT ")) == \
        sorted([f"OUT {tmp_path / 'ranks'}", "OUT None"]), done.stdout
    assert len((tmp_path / "imports.log").read_text().split()) == 4
    assert sum(not row.get("final") for row in map(json.loads, (tmp_path / "ranks" / "metrics.jsonl").open())) == 2
    assert [path.suffix for path in (tmp_path / "cache" / "datasets").iterdir()] == [""]  # one folder, no .partial


def test_a_failed_run_raises_with_its_exit_code(tmp_path, capsys):
    """Claim: a run that fails (here: an option out of range) raises RuntimeError naming its exit code and the
    command line it ran, after the usual one `error:` line on stderr; nothing is left running."""
    with pytest.raises(RuntimeError, match=r"exit code 2 .*: python trainer.py --model=tiny --reward math "
                                           r"--iterations=0"):
        trainer.train("tiny", "math", iterations=0, out=str(tmp_path / "run"))
    said = capsys.readouterr().err
    assert "--iterations" in said and said.count("\n") == 1, said
    assert not (tmp_path / "run").exists()


def test_args_are_a_config_file_and_keywords_win(tmp_path, monkeypatch):
    """Claim: `args`, TRL's GRPOConfig or anything with its to_dict() (or a mapping), is read as a --config file is
    (its TRL keys translated: max_steps, the batch keys), written once under $PERIODIC_RL_CACHE/configs, and a
    keyword wins over it as a typed option wins over a file's; anything else is refused in one line."""
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))

    class Args:  # what GRPOConfig offers: to_dict()
        def to_dict(self):
            return {"learning_rate": 1e-5, "num_generations": 4, "max_steps": 6, "per_device_train_batch_size": 8,
                    "steps_per_generation": 2, "seed": 42}
    argv = python_args.train_argv("tiny", args=Args(), seed=7)
    assert argv[0] == "--config" and Path(argv[1]).parent == tmp_path / "configs"
    assert python_args.train_argv("tiny", args=Args(), seed=7) == argv  # the same file, not another
    cfg = parse_args(argv)
    assert (cfg.lr, cfg.group_size, cfg.iterations, cfg.batch_size, cfg.updates_per_iteration, cfg.seed) == \
        (1e-5, 4, 3, 16, 2, 7)
    with pytest.raises(ValueError, match="args is a list: give TRL's GRPOConfig or a mapping of options"):
        python_args.train_argv("tiny", args=[1])


def test_a_scripts_reward_is_found_in_a_spawned_process_too(tmp_path, monkeypatch):
    """Claim: in a spawned process, where the script is `__mp_main__`, a function of the script
    is still named by the script's path (config.json recorded '__mp_main__:f', which no command line can load);
    a reward file that is the running script is not run again, unless the function is not there yet (defined below
    its `if __name__ == "__main__":` block, which was running); report_to=[] is TRL's "no tracker"."""
    import types

    from infra.reward import load_reward
    script = tmp_path / "script.py"
    script.write_text("def f(prompt, completion, answer):\n    return 1.0\n\n\ndef g(prompt, completion, answer):\n"
                      "    return 2.0\n")
    running = types.ModuleType("__mp_main__")
    running.__file__ = str(script)

    def f(prompt, completion, answer):
        return 3.0
    f.__module__, f.__qualname__, running.f = "__mp_main__", "f", f
    monkeypatch.setitem(sys.modules, "__mp_main__", running)
    monkeypatch.setitem(sys.modules, "__main__", running)
    assert python_args.reward_spec(f) == f"{script}:f"
    assert load_reward(f"{script}:f") is f  # the running script's own function: the file is not run again
    assert load_reward(f"{script}:g")("", "", "") == 2.0  # not defined in the running script yet: the file's
    assert python_args.train_argv(report_to=[]) == ["--report-to", "none"]


def test_a_callable_object_and_the_args_weights_and_resume(tmp_path, monkeypatch):
    """Claim: a callable object at the top level of a module is found by its name there; the args' reward_weights go with the rewards given to train (a typed --reward re-derives a file's
    weights), and its resume_from_checkpoint resumes, as TRL's scripts pass it on to
    trainer.train (a --config file alone never resumes)."""
    from infra.reward import load_reward
    assert python_args.reward_spec(rewards.scaled_half) == "rewards:scaled_half"
    assert python_args.reward_spec(rewards.made_reward) == "rewards:made_reward"  # a partial, in the reward's module
    assert load_reward("rewards:scaled_half") is rewards.scaled_half
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    argv = python_args.train_argv("tiny", reward_funcs=["math", "math-verify"],
                                args={"reward_weights": [1.0, 0.5], "resume_from_checkpoint": True,
                                      "output_dir": str(tmp_path / "run")})
    cfg = parse_args(argv)
    assert (cfg.reward, cfg.reward_weights, cfg.resume) == (["math", "math-verify"], [1.0, 0.5], "auto")
    again = python_args.train_argv("tiny", args={"resume_from_checkpoint": str(tmp_path / "c"),
                                                 "output_dir": str(tmp_path / "run")}, resume="auto")
    assert parse_args(again).resume == "auto"  # the keyword wins (both names typed were one line: refused)


STDIN_SCRIPT = '''
import sys
sys.path.insert(0, {root!r})
import trainer
from infra import python_args
if __name__ == "__main__":
    try:
        trainer.train("tiny", "math", data="arithmetic", mode="async", iterations={iterations}, batch_size=16,
                      group_size=4, max_new_tokens=4, eval_every=0, groups_per_call=2, micro_batch_tokens=64,
                      rollout_threads=1, train_threads=1, out={out!r})
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        raise SystemExit(130)
    print("OUT done")
'''


@pytest.mark.slow  # process-level: trainer.train with its inference process, from a script read on stdin
def test_train_from_stdin_runs_and_ctrl_c_is_a_keyboard_interrupt(tmp_path):
    """Claim: a script read from stdin (`python < script.py`, as a notebook's cell is not a
    file either) runs train in async mode: multiprocessing's spawn would run the script's path, '<stdin>', again, and
    the inference process died with a traceback before the first row; Ctrl-C during that run is the
    KeyboardInterrupt a script expects, after the run stopped and said
    so, nothing left running. One process shows both."""
    import signal
    import time
    env = {**os.environ, "PERIODIC_RL_CACHE": os.environ.get("PERIODIC_RL_CACHE", str(ROOT / ".cache" / "periodic-rl"))}
    run = subprocess.Popen([sys.executable], cwd=tmp_path, env=env, text=True, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # the script on stdin
                           preexec_fn=as_from_a_terminal())  # SIGINT at its default, wherever the suite was started
    run.stdin.write(STDIN_SCRIPT.format(root=str(ROOT), iterations=100_000, out=str(tmp_path / "b")))
    run.stdin.close()
    run.stdin = None  # closed: communicate must not flush it
    deadline = time.monotonic() + hang_bound(120)
    while not (tmp_path / "b" / "metrics.jsonl").exists() or not (tmp_path / "b" / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130 and "KeyboardInterrupt" in out and "interrupted by SIGINT" in err, (out, err)
    assert "iter    0" in out  # trained from stdin (its inference process died before the first row)


def test_trls_other_keywords_are_options_or_one_line(tmp_path, monkeypatch, capsys):
    """Claim: TRL's peft_config (peft's LoraConfig) is --use-peft with its r, alpha, dropout
    and modules (the Config equals the typed one), a field no option expresses is one ValueError; a model object
    and a processing_class from elsewhere are one ValueError naming what to give (each process loads its own copy:
    the model object's printed form once became --model, and an error hundreds of characters long); a tokenizer
    from --model's own place is accepted; an empty Dataset (or eval_dataset) is one ValueError, not an IndexError
    from a cache folder the user never made; a reward defined under `if __name__ == "__main__":` is refused up front
    (the inference process imports the script without running that block, and failed later)."""
    import types

    from peft import LoraConfig
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    assert parse_args(python_args.train_argv("tiny", "math", peft_config=lora)) == parse_args(
        ["--model", "tiny", "--reward", "math", "--use-peft", "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout",
         "0.05", "--lora-target-modules", "q_proj", "v_proj"])
    assert "--lora-r=2" in python_args.train_argv("tiny", peft_config=lora, lora_r=2)  # a keyword wins
    with pytest.raises(ValueError, match="^train: peft_config: LoraConfig's bias='all' has no option here"):
        trainer.train("tiny", "math", peft_config=LoraConfig(bias="all"))
    with pytest.raises(ValueError, match="^train: model is a Linear object; give its hub id or a folder"):
        trainer.train(torch.nn.Linear(2, 2), "math")
    with pytest.raises(ValueError, match="^train: processing_class loaded from 'elsewhere': the tokenizer is loaded"):
        trainer.train("tiny", "math", processing_class=types.SimpleNamespace(name_or_path="elsewhere"))
    assert python_args.train_argv("tiny", processing_class=types.SimpleNamespace(name_or_path="tiny")) == \
        ["--model=tiny"]
    assert python_args.model_name("qwen2.5-0.5b", types.SimpleNamespace(name_or_path="Qwen/Qwen2.5-0.5B-Instruct"))
    assert "changes made to this one in Python (its chat template, pad token) are not seen" in capsys.readouterr().out
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path / "cache"))
    empty, one = (datasets.Dataset.from_dict({"prompt": rows, "answer": rows}) for rows in ([], ["1"]))
    with pytest.raises(ValueError, match="^train: train_dataset has no rows"):
        trainer.train("tiny", "math", train_dataset=empty)
    with pytest.raises(ValueError, match="^train: eval_dataset has no rows"):
        trainer.train("tiny", "math", train_dataset=one, eval_dataset=empty)
    script = tmp_path / "script.py"
    script.write_text("def top(prompt, completion, answer):\n    return 1.0\n\n\nif __name__ == '__main__':\n"
                      "    def inner(completions, **kwargs):\n        return [1.0] * len(completions)\n")
    running = types.ModuleType("__main__")
    running.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), vars(running))
    monkeypatch.setitem(sys.modules, "__main__", running)
    for function in (running.top, running.inner):
        function.__module__ = "__main__"
    assert python_args.reward_spec(running.top) == f"{script}:top"
    with pytest.raises(ValueError, match=r"reward 'inner' is defined under `if __name__ == \"__main__\":`"):
        python_args.reward_spec(running.inner)
    for text, main_only in (("from helpers import *\nif __name__ == '__main__':\n    acc = 1\n", set()),  # any name
                            ("if __name__ != '__main__':\n    def a(): pass\nelse:\n    def b(): pass\n", {"b"}),
                            ("(acc := 1)\nif __name__ == '__main__':\n    acc = 2\n    def b(): pass\n", {"b"})):
        script.write_text(text)
        assert python_args.main_only_names(script) == main_only, text


def test_a_grpo_configs_unset_keys_say_nothing(tmp_path, monkeypatch, capsys):
    """Claim (train(args=GRPOConfig(...)) printed "ignored 85 of TRL's keys" and named a cache
    file the user never wrote): keys of no use here left at the class's defaults are dropped before the file is
    written; one of no use that the user set is still said; an option at TRL's default is still TRL's (beta 0.0, not
    ours); the lines name train's args. A dataclass shaped as GRPOConfig stands in (trl is optional here)."""
    import dataclasses

    @dataclasses.dataclass
    class GRPOConfig:
        learning_rate: float = 1e-6
        beta: float = 0.0
        logging_strategy: str = "steps"
        push_to_hub: bool = False
        hub_strategy: str = "every_save"
        hub_token: str | None = None
        use_vllm: bool = False
        disable_tqdm: bool | None = None
        tf32: bool | None = None
        bf16: bool | None = None

        def to_dict(self) -> dict:  # as TrainingArguments.to_dict: tokens hidden, bf16 and disable_tqdm resolved
            return {**dataclasses.asdict(self), "hub_token": "<HUB_TOKEN>", "disable_tqdm": False, "bf16": False}

    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    assert python_args.args_values(GRPOConfig(push_to_hub=True)) == {"learning_rate": 1e-6, "beta": 0.0,
                                                                     "push_to_hub": True, "bf16": False}
    assert python_args.args_values(GRPOConfig(tf32=False))["tf32"] is False  # set: False is not None (the test
    # `in (None, False)` once made it unset and dropped it silently, where a --config file refuses it)
    cfg = parse_args(python_args.train_argv("tiny", "math", args=GRPOConfig(push_to_hub=True)))
    assert (cfg.beta, cfg.lr, cfg.dtype) == (0.0, 1e-6, "float32")
    out = capsys.readouterr().out
    assert "periodic-rl: train's args: ignored TRL's push_to_hub: <out>/policy is a Hugging Face model" in out, out
    assert not any(key in out for key in ("hub_strategy", "use_vllm", "logging_strategy", "disable_tqdm", "bf16:",
                                          str(tmp_path))), out


def test_train_returns_the_run_as_a_path_with_trls_results(tmp_path):
    """Claim: train returns the run's folder as a Path (equal to --out, its str the path, `/` and os.fspath work as on
    any Path) that also gives what TRL's trainer does once trained: `log_history`, metrics.jsonl's rows; `policy_path`,
    the saved policy; `save_model(dir)`, a copy of it that from_pretrained loads with the same weights. Without a
    saved policy, save_model is one ValueError."""
    from safetensors.torch import load_file
    options = dict(data="arithmetic", mode="sync", iterations=1, batch_size=8, group_size=4, max_new_tokens=4,
                   eval_every=0, groups_per_call=2, micro_batch_tokens=64, rollout_threads=1, train_threads=1)
    result = trainer.train("tiny", "math", out=str(tmp_path / "run"), **options)
    assert isinstance(result, Path) and result == tmp_path / "run" and str(result) == str(tmp_path / "run")
    assert os.fspath(result / "metrics.jsonl") == str(tmp_path / "run" / "metrics.jsonl")
    assert result.log_history == [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [row["iteration"] for row in result.log_history if not row.get("final")] == [0]
    assert result.policy_path == tmp_path / "run" / "policy"
    copy = result.save_model(tmp_path / "copy")
    saved, copied = (load_file(folder / "model.safetensors") for folder in (result.policy_path, copy))
    assert saved.keys() == copied.keys() and all(torch.equal(saved[k], copied[k]) for k in saved)
    unsaved = trainer.train("tiny", "math", out=str(tmp_path / "unsaved"), save=False, **options)
    assert unsaved.policy_path is None and unsaved.log_history
    with pytest.raises(ValueError, match="saved no policy"):
        unsaved.save_model(tmp_path / "nothing")
