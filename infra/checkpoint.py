"""Checkpoints: what an exact resume needs, written so that a kill at any moment never leaves a torn one.

    <out>/checkpoint-<k>/          k = iterations done: a resumed run starts at iteration k
        policy/                    θ_k, a Hugging Face model directory (from_pretrained loads it alone; with
                                   --use-peft the LoRA adapter alone, as peft saves it)
        optimizer.pt               AdamW's state_dict: both moments and the step count of every parameter
        scheduler.pt               the learning-rate schedule's state_dict: the optimizer steps taken
        state.json                 k, the run's resolved config (sizes and threads included), θ_0's fingerprint

Nothing else is needed, because everything else an iteration uses is a function of these:
- the reference π_ref = θ_0 is the run's `--model`, loaded again at resume and checked against the
  fingerprint saved here (a SHA-256 of its parameters), so no second full copy lies on disk;
- the old policy θ_old is θ_k itself at an iteration boundary;
- rollouts are sampled from seeds derived from (seed, iteration, prompt index) (rollout.prompt_seed),
  and prompts are picked by (seed, iteration) (rollout.iteration_prompts): no RNG state carries over;
- the sizes (generate calls, micro-batch, threads) are in the config, so a resume batches the same
  groups together and sums in the same order: with equal thread counts it is bitwise the run that was
  never interrupted (tests/cli/test_checkpoint.py).

Resuming takes the checkpoint's config; options that do not change the result (evaluation cadence,
outputs, devices, threads, ...; iterations where the learning rate does not depend on the run's length) may
be given anew; any other option given with a different value is refused, naming it (`resumed_config`).
How big a checkpoint is: the policy in float32 plus AdamW's two moments, 3 x 4 bytes per parameter
(Qwen2.5-0.5B: 0.49 G parameters, ~5.9 GB).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from config import Config
from infra.command_line import given_values, parse_args
from infra.errors import UserError
from infra.options import validate, with_new_names
from infra.outputs import checkpoints, is_record, save_atomically, writing
from infra.records import RECORD, absolute_paths, through_moved_link

# Options a resumed run may give anew: they decide how long, where, on what and how often to report, or change
# float rounding only (sums in another order, other kernels), not what is computed. Not given, they stay the
# checkpoint's, so that by default a resume is bitwise the run that was never interrupted. (Two exceptions,
# `resumed_config`: with --loss-type bnpo the micro-batches change the loss; and a learning-rate schedule that
# spans the run's optimizer steps would be rebuilt over another --iterations' steps, changing every rate from the
# checkpoint on: the resumed run would be neither the one it continues nor one started with that length.)
HARMLESS = {"iterations", "num_train_epochs", "eval_every", "eval_samples", "trace", "save", "save_every",
            "keep_checkpoints", "save_on_stop", "sizes", "cache_dir", "reward_timeout", "gradient_checkpointing",
            "compile_train", "attn_implementation", "micro_batch_tokens", "pad_to_multiple_of", "rollout_threads",
            "train_threads", "train_threads_after_sampling", "report_to", "collective_timeout",
            "inference_workers",  # the groups reach the trainer in one worker's order (inference.in_call_order)
            "log_completions", "num_completions_to_print", "eval_every_epoch", "save_dtype",
            "mode"}  # async and sync are the same run (bitwise, with equal thread counts: tests/method/test_pipeline.py)
# (Not eval_size: for data without a held-out split the held-out rows are the last eval_size, kept out of training.)
DEVICES = {"device", "rollout_device", "train_device"}  # given one, all three are this run's (derived together)
THIS_RUN = {"out", "resume", "overwrite", "config",  # where the checkpoint was found and how
            "inference_ranks"}  # how this launch's torchrun ranks are used, never the saved run's


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or does not belong to this run."""


def fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's name, shape, dtype and bytes: tells θ_0 from any other weights."""
    digest = hashlib.sha256()
    for name, parameter in model.state_dict().items():
        tensor = parameter.detach().to("cpu").contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def save(out: str | Path, iterations_done: int, policy, tokenizer, optimizer: torch.optim.Optimizer, cfg: Config,
         reference_fingerprint: str, keep: int = 0, scheduler=None) -> Path:
    """Write <out>/checkpoint-<iterations_done> atomically (with the learning-rate `scheduler`'s state if given); then
    keep only the newest `keep` (0: all). A full disk is one OutputError naming the checkpoint (the previous ones
    stay)."""
    target = Path(out) / f"checkpoint-{iterations_done}"

    def write(directory: Path) -> None:
        policy.save_pretrained(directory / "policy", safe_serialization=True)
        tokenizer.save_pretrained(directory / "policy")
        torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), directory / "scheduler.pt")
        state = {"iterations_done": iterations_done, "config": dataclasses.asdict(absolute_paths(cfg)),  # from anywhere
                 "reference_fingerprint": reference_fingerprint}
        (directory / "state.json").write_text(json.dumps(state, indent=1))

    with writing("the checkpoint", target):
        save_atomically(target, write)
    if keep:
        for old in checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def find(resume: str, out: str | Path) -> Path | None:
    """--resume PATH (a checkpoint directory) or auto (the newest complete one in --out; None if there is none yet:
    the run starts from iteration 0, infra/outputs.claimed)."""
    if resume == "auto":
        found = checkpoints(out)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"--resume {resume}: not a checkpoint directory (no state.json in it); "
                              f"pass a <out>/checkpoint-<k> directory or --resume auto")
    return path


def read_state(path: Path) -> dict:
    """state.json, with one clear line if it cannot be read."""
    try:
        state = json.loads((path / "state.json").read_text())
        config = with_new_names(dict(state["config"]))  # an option's old name (infra/options.RENAMED) as its new
        if isinstance(config.get("reward"), str):  # written before --reward was repeatable: its one reward, weight 1
            config["reward"] = [config["reward"]]
            config.setdefault("reward_weights", [1.0])
        config.setdefault("train_threads_after_sampling", config.get("train_threads"))  # written before it: no switch
        config.setdefault("lr_scheduler_type", "constant")  # written before the schedule: the rate it ran at
        config.setdefault("text_prompts", "chat")  # written before --text-prompts: text was always in the template
        if isinstance(config.get("scale_rewards"), bool):  # written before "batch": TRL's names for the booleans
            config["scale_rewards"] = "group" if config["scale_rewards"] else "none"
        return {"iterations_done": int(state["iterations_done"]), "config": config,
                "reference_fingerprint": str(state["reference_fingerprint"])}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}: {error}); "
                              f"resume from another one or start afresh") from None


def schedule_spans_the_run(saved: dict) -> bool:
    """Whether a run's learning rates (its config, as saved) depend on how many optimizer steps it has: every
    decaying schedule, and a warmup given as a ratio of the steps (launch/setup.build_optimizer); not a constant
    rate, nor constant_with_warmup and inverse_sqrt without warmup (inverse_sqrt's timescale is then 10^4 steps)."""
    length_free = saved.get("lr_scheduler_type", "constant") == "constant" or (
        saved.get("lr_scheduler_type") in ("constant_with_warmup", "inverse_sqrt") and not saved.get("warmup_ratio")
        and not 0 < saved.get("warmup_steps", 0) < 1)  # a warm-up of whole steps does not depend on the run's length
    return not length_free


def resumed_config(cfg: Config, given: set[str], state: dict) -> Config:
    """The checkpoint's config, but the harmless options given anew; a result-changing option given with another
    value than the checkpoint's is refused, naming it."""
    saved, values, absolute = state["config"], {}, absolute_paths(cfg)
    harmless = set(HARMLESS)
    if saved.get("loss_type") == "bnpo":  # bnpo averages each micro-batch's own token mean
        harmless.discard("micro_batch_tokens")
    if schedule_spans_the_run(saved):  # the schedule's length is iterations x updates x μ optimizer steps
        harmless -= {"iterations", "num_train_epochs"}
    for field in dataclasses.fields(Config):
        name, new = field.name, getattr(cfg, field.name)
        anew = name in given or name in DEVICES and bool(given & DEVICES)
        if name not in saved or name in THIS_RUN or anew and (name in harmless or name in DEVICES):
            values[name] = new
        elif (anew and new != saved[name] and getattr(absolute, name) != saved[name]  # data/ == /run/from/data
              and not (name == "data" and saved[name] is None and new == saved_default_data(saved))):
            option = "--" + name.replace("_", "-")
            why = "" if name != "iterations" else (
                f" (its learning-rate schedule, {saved.get('lr_scheduler_type')}"
                f"{' with warmup' if saved.get('warmup_ratio') or saved.get('warmup_steps') else ''}, spans the run's "
                "optimizer steps: another "
                "length gives other rates; a run at a constant rate can be extended)")
            raise CheckpointError(f"{option} {new} differs from the checkpoint's {saved[name]}: it would change "
                                  f"the run{why}, so it cannot be resumed with it (drop {option}, or start a new "
                                  "run from the checkpoint's weights: --model and its folder, AdamW's state afresh)")
        else:
            values[name] = saved[name]
    if "iterations" in given and "num_train_epochs" not in given:  # a typed length wins over the saved epochs
        values["num_train_epochs"] = None
    return dataclasses.replace(cfg, **values)


def saved_default_data(saved: dict) -> str:
    """The task a checkpoint's run trained on when its --data was left out (None): its model's default."""
    return Config(model=saved["model"]).default_data


def source_model(cfg: Config, typed: str, saved: str) -> str | None:
    """The --model a resume takes from where the one given (`typed`, followed to cfg.model) is not the checkpoint's
    source (`saved`, as the run resolved it): through a link that has moved since (runs/latest, after another run),
    still the source, said in one line: it is the same command; where the source no longer exists, the model given
    (`restore` checks its weights against θ_0's fingerprint), said in one line, or a CheckpointError when it does not
    exist either. Else None: the same model, or another one (resumed_config refuses it)."""
    new = cfg.model
    if absolute_paths(cfg).model == saved or not os.path.isabs(saved):  # the same, or the run's was a hub name
        return None
    if os.path.exists(saved):
        if not through_moved_link(typed, saved):  # no link on the way: another model
            return None
        print(f"periodic-rl: --model {typed} now leads to {new}, not to {saved}, where the run in --out began (the "
              f"link moved): continuing from {saved}", flush=True)
        return saved
    if not os.path.isdir(os.path.expanduser(new)):
        raise CheckpointError(f"--model {typed}: the checkpoint's source model, {saved}, no longer exists (moved or "
                              "deleted): put it back, or pass --model with the folder it is in now (its weights are "
                              "checked against the checkpoint's initial ones)")
    print(f"periodic-rl: --model {typed}: the checkpoint's source model, {saved}, no longer exists: continuing from "
          f"{new}, whose weights are checked against the checkpoint's initial ones", flush=True)
    return new


def restarted_config(cfg: Config, argv: list[str] | None) -> Config:
    """--resume auto where --out holds a run that stopped before its first checkpoint: it starts again from
    iteration 0 as that run was started (its command line, config.json's `command`, read again with `argv`, the
    command line given now, after it: what is given now wins), so that the same short command resubmitted
    (`--resume auto --out DIR`) restarts the same run, not the defaults. What depends on the options (the model's
    defaults, the devices, the sizes) is derived again, on this machine. `cfg` as it is where the record is missing
    or its command no longer parses (a relative --config file, from another folder), with a line saying so."""
    record = Path(cfg.out) / RECORD if cfg.out else None
    if argv is None or record is None or not is_record(record):
        return cfg
    command = json.loads(record.read_text()).get("command")
    if not isinstance(command, list) or not command or not str(command[0]).endswith("trainer.py"):
        return cfg
    then = [str(arg) for arg in command[1:] if str(arg) not in ("--overwrite", "--no-overwrite")]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as said:
            restarted, typed = parse_args([*then, *argv]), set(given_values(then)) - set(given_values(argv))
    except (SystemExit, ValueError):
        print(f"periodic-rl: --resume auto: the command of the run in {cfg.out} ({' '.join(then)}) no longer reads "
              f"({said.getvalue().strip() or 'refused'}): restarting with the options given now", flush=True)
        return cfg
    typed -= THIS_RUN
    if typed:
        print(f"periodic-rl: --resume auto: restarting with the options of the run in {cfg.out}: "
              + " ".join("--" + name.replace("_", "-") for name in sorted(typed)), flush=True)
    return dataclasses.replace(restarted, inference_ranks=cfg.inference_ranks)


def resumption(cfg: Config, given: set[str], typed_model: str | None = None,
               argv: list[str] | None = None) -> tuple[Config, Path | None]:
    """--resume: (the config the checkpoint fixes, the checkpoint); (cfg, None) without --resume, and with --resume
    auto where --out holds no checkpoint yet (then with the options of the run that stopped there, if any). A
    checkpoint named by its path continues in its own run directory unless --out is given. `typed_model`: --model as
    typed, if given (`source_model`); `argv`: the command line (`restarted_config`)."""
    if cfg.resume is None:
        return cfg, None
    path = find(cfg.resume, cfg.out)
    if path is None:  # --resume auto before the run's first checkpoint: it starts (again) from iteration 0
        return restarted_config(cfg, argv), None
    state = read_state(path)
    if cfg.resume != "auto" and "out" not in given:
        cfg = dataclasses.replace(cfg, out=str(path.parent))
    if typed_model is not None and (source := source_model(cfg, typed_model, state["config"]["model"])):
        state["config"]["model"] = source  # the run goes on from there (its weights: θ_0's, restore checks)
        cfg = dataclasses.replace(cfg, model=source)
    cfg = resumed_config(cfg, given, state)
    done = state["iterations_done"]
    if cfg.iterations < done:  # its θ_k would be saved as the policy of fewer iterations
        raise CheckpointError(f"--iterations {cfg.iterations} is fewer than the {done} iterations checkpoint {path} "
                              f"has done: give --iterations {done} or more, or resume from an earlier checkpoint")
    problems = validate(cfg)
    if problems:
        raise CheckpointError(f"the checkpoint's options, with those given anew, are refused: {problems[0]}")
    print(f"periodic-rl: resuming from {path} at iteration {done} of {cfg.iterations}", flush=True)
    return cfg, path


def restore(path: Path, policy, optimizer: torch.optim.Optimizer, reference_fingerprint: str, scheduler=None) -> int:
    """θ_k, AdamW's state and the learning-rate schedule's (`scheduler`, if given) into the run's policy, optimizer
    and schedule (whose reference is θ_0, just loaded); returns k, the iteration to resume at. A checkpoint from
    before the schedule (no scheduler.pt) ran at a constant rate, which needs no state."""
    state = read_state(path)
    if state["reference_fingerprint"] != reference_fingerprint:
        raise CheckpointError(f"checkpoint {path} was trained from other initial weights than this run's --model "
                              f"(θ_0's fingerprint differs): the model changed since; resume with the same model")
    from safetensors.torch import load_file
    try:
        weights = {}
        for file in sorted((path / "policy").glob("*.safetensors")):
            weights.update(load_file(file))
        if hasattr(policy, "peft_config"):  # --use-peft: policy/ holds the LoRA adapter alone (peft's format)
            from infra.models import load_adapter_weights
            load_adapter_weights(policy, weights)
        else:
            missing, unexpected = policy.load_state_dict(weights, strict=False)
            tied = {name for name in missing if getattr(policy.config, "tie_word_embeddings", False)
                    and name.endswith("lm_head.weight")}
            if set(missing) - tied or unexpected:
                raise ValueError(f"missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        if scheduler is not None and (state["config"]["lr_scheduler_type"] != "constant"
                                      or (path / "scheduler.pt").exists()):
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    except Exception as error:  # a torn or foreign file fails in many ways (unpickling, safetensors, shapes)
        raise CheckpointError(f"checkpoint {path} is damaged ({type(error).__name__}: {str(error)[:200]}); "
                              f"resume from an older one (--resume <out>/checkpoint-<k>)") from None
    return state["iterations_done"]
