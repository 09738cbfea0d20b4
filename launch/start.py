"""Everything `trainer.main` does before the loop that is not the method: the command line read (TRL's names and
files, --resume, torchrun's roles), the devices checked, the task and the rewards read, the policy loaded.

Any problem a user can fix ends in a UserError, one line (launch/exits.py says it).
"""
from __future__ import annotations

import dataclasses
import math
import os
from contextlib import contextmanager, nullcontext, redirect_stdout

from config import Config
from infra import outputs
from infra.command_line import given_values, named_as_typed, parse_args
from infra.errors import UserError


def options(argv: list[str], end) -> tuple[Config | None, object, object]:
    """(the options, the checkpoint --resume continues from or None, this process's ranks): the command line with
    TRL's names and --config files read, --resume's options, torchrun's ranks split into trainer and inference ranks
    and the devices placed; (None, None, ranks) when the same command was resubmitted once its run is complete (a
    line says so). `end` (launch/exits.Ending) learns the options and ranks as they are known, for its last line."""
    shorten_openmp_spinning()  # before torch is imported
    import numpy  # noqa: F401  before torch, whose C extension imports numpy and clears any error: a Ctrl-C
    # there was swallowed and left numpy half-imported (the run went on, then crashed at save)
    end.cfg = cfg = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # two processes, each with its own threads
    from infra import checkpoint, distributed, records
    typed = given_values(argv)  # the options named, as typed (--model before a link is followed)
    given, end.ranks = set(typed), distributed.from_environment()  # torchrun's ranks; else one
    distributed.die_with_launcher(end.launcher)
    with quiet_unless_main(end.ranks):
        if line := records.finished(cfg, given, typed.get("model")):  # the same command resubmitted
            print(f"periodic-rl: {line}", flush=True)
            return None, None, end.ranks
        end.cfg = cfg = outputs.resume_or_start(cfg)  # --resume auto where --out holds no run: a new one
        try:
            cfg, resume_from = checkpoint.resumption(cfg, given, typed.get("model"), argv)  # --resume's options
        except UserError as error:  # its options named as typed (--max-steps, --learning-rate)
            error.args = (named_as_typed(str(error), argv, cfg.iterations),)
            raise
        end.cfg = cfg
        end.ranks = ranks = distributed.split_roles(end.ranks, cfg.inference_ranks)  # trainer ranks, then inference
        end.cfg = cfg = distributed.place(cfg, ranks, given)  # (rank 0 alone logs, above, and writes --out)
        distributed.check(cfg, ranks)
        if ranks.world > 1:  # before the process group, whose backend needs it (torch_npu registers hccl)
            device = "rollout_device" if ranks.is_inference else "train_device"
            check_device(getattr(cfg, device), "--" + device.replace("_", "-"))
    return cfg, resume_from, ranks


@contextmanager
def quiet_unless_main(ranks):
    """Standard output to /dev/null on every rank but 0, for the block (rank 0 alone logs)."""
    with open(os.devnull, "w") as devnull, redirect_stdout(devnull) if not ranks.is_main else nullcontext():
        yield


class DeviceError(UserError):
    pass


def check_device(device: str, option: str = "--device") -> None:
    """Fail early, in one line, when a named device does not exist (imports torch_npu only for npu)."""
    import torch
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
        except ImportError as error:
            raise DeviceError(f"{option} {device} needs the Ascend adapter torch_npu, which is not installed "
                              f"({error}); install the torch_npu build matching torch {torch.__version__}") from None
        if not torch.npu.is_available():
            raise DeviceError(f"{option} {device}: torch_npu is installed but no NPU is visible")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{option} {device}: this torch build sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu or --device auto")
    count = getattr(torch, kind).device_count()
    if index and int(index) >= count:
        raise DeviceError(f"{option} {device}: this machine has {count} {kind} device(s), {kind}:0 to "
                          f"{kind}:{count - 1} (check CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES)")


def prepare(cfg: Config) -> tuple[Config, object, object, dict]:
    """Check the devices, load the task and the rewards (a typo there fails in a second): (the options with the
    prompt column read (config.json records it), the task (data.Task: train and held-out examples, what the first
    line says of them), reward functions and weights, how a model is loaded)."""
    import torch

    from infra.data import read_task
    from infra.reward import load_rewards
    for option in ("rollout_device", "train_device"):
        for device in getattr(cfg, option).split(","):  # --rollout-device: one per inference worker
            check_device(device, "--device" if device == cfg.device else "--" + option.replace("_", "-"))
    torch.manual_seed(cfg.seed)
    load_kwargs = dict(device=cfg.rollout_device, dtype=getattr(torch, cfg.dtype),
                       attn_implementation=cfg.attn_implementation, cache_dir=cfg.cache_dir, lora=cfg.lora)
    rewards = load_rewards(cfg.reward, cfg.reward_weights)  # first: the data must hold what they need
    task = read_task(cfg.data, cfg.default_data, cfg.eval_size, cfg.data_config, cfg.split, cfg.prompt_column,
                     cfg.answer_column, cfg.system_prompt, rewards.needed_columns(), cfg.eval_split)
    if cfg.num_train_epochs is not None:  # the run's length in passes over the training prompts (TRL's)
        iterations = epoch_iterations(cfg.num_train_epochs, len(task.train), cfg.prompts_per_iteration)
        cfg = dataclasses.replace(cfg, iterations=iterations)
        task = dataclasses.replace(task, notes=(*task.notes, f"--num-train-epochs {cfg.num_train_epochs:g}: "
                                                             f"{iterations} iterations"))
    if cfg.eval_every_epoch:  # TRL's eval_strategy 'epoch': every pass over the training prompts
        eval_every = epoch_iterations(1, len(task.train), cfg.prompts_per_iteration)
        cfg = dataclasses.replace(cfg, eval_every=eval_every)
        task = dataclasses.replace(task, notes=(*task.notes, f"--eval-every-epoch: every {eval_every} iterations"))
    if len(task.train) < cfg.prompts_per_iteration:  # an iteration spans epochs (rollout.iteration_prompts)
        task = dataclasses.replace(task, notes=(*task.notes, f"{len(task.train)} training prompt(s), fewer than the "
                                                             f"{cfg.prompts_per_iteration} an iteration takes: each "
                                                             "iteration samples some of them more than once"))
    eval_size = len(task.held_out) if cfg.eval_size is None else cfg.eval_size  # what auto took (config.json says)
    return dataclasses.replace(cfg, prompt_column=task.prompt_column, eval_size=eval_size), task, rewards, load_kwargs


def epoch_iterations(epochs: float, train_prompts: int, prompts_per_iteration: int) -> int:
    """The iterations of `epochs` passes over the training prompts, the last one completed (TRL rounds a run's
    steps up too), at least one.

    >>> epoch_iterations(1, 7473, 16), epoch_iterations(0.5, 100, 16), epoch_iterations(3, 2255, 16)
    (468, 4, 423)
    """
    return max(1, math.ceil(epochs * train_prompts / prompts_per_iteration))


def load_policy(cfg: Config, load_kwargs: dict, rollouts=None):
    """The trainable policy (float32 masters, on cfg.train_device) and its tokenizer. The tiny model is built
    first if it is not cached yet, and only then may the inference process (`rollouts`) load it."""
    import torch
    import transformers

    from infra.models import load_model
    from infra.tiny import TINY_RECIPES, ensure_tiny_model
    transformers.utils.logging.disable_progress_bar()  # our own progress bar and log lines only
    if rollouts is not None:
        if cfg.is_tiny:  # load_model would build it too, but the inference process must not race the build
            ensure_tiny_model(cfg.cache_dir, TINY_RECIPES[cfg.model])
        rollouts.load()
    return load_model(cfg.model, **{**load_kwargs, "device": cfg.train_device, "dtype": torch.float32})



def say_start(cfg: Config, policy, tokenizer, task, ranks) -> None:
    """The run's first line (infra/console.start_line: the task, the ranks, the memory estimate), once every prompt
    is checked to fit the model's context with --max-completion-length."""
    from infra.console import start_line, text_prompts_note
    from infra.tasks import check_prompt_lengths, raw_text_prompts, template_kwargs
    from launch import sizing
    raw = raw_text_prompts(cfg.text_prompts, cfg.prompt_column)
    check_prompt_lengths(tokenizer, task.train + task.held_out, getattr(policy.config, "max_position_embeddings",
                                                                        None), cfg.max_new_tokens,
                         template_kwargs(cfg.chat_template_kwargs), raw)
    notes = task.notes + text_prompts_note(tokenizer, task.train, raw)
    memory = sizing.memory_estimate(cfg, sum(p.numel() for p in policy.parameters()),
                                    sum(p.numel() for p in policy.parameters() if p.requires_grad))
    print(start_line(cfg, len(task.train), len(task.held_out), notes, ranks.size, ranks.inference, memory),
          flush=True)


def serve(cfg: Config, ranks) -> None:
    """An inference rank (--inference-ranks): the task and rewards as a trainer loads them, then remote.serve."""
    from launch import remote
    cfg, task, rewards, load_kwargs = prepare(cfg)
    remote.serve(cfg, ranks, task.train, task.held_out, rewards, load_kwargs)


def shorten_openmp_spinning(environ=os.environ) -> None:
    """Idle OpenMP threads spin 300,000 times before they sleep (libgomp's default; libgomp is the OpenMP runtime of
    torch's wheels), milliseconds of a core. When the trainer and inference processes take turns on the same
    cores, the side that has just finished spins through the other's first milliseconds (docs/benchmarks.md).
    30,000 spins still outlast the gap between two ops of one process (sync mode runs as fast). Call before torch
    is imported (libgomp reads it once, when torch loads it); the inference processes inherit it. A user's own
    GOMP_SPINCOUNT or OMP_WAIT_POLICY wins."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = "30000"
