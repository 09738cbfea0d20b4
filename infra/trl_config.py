"""TRL's configuration as our options: the tables of infra/trl_names.py applied to a --config file's keys
(`trl_keys`, with transformers' TrainingArguments keys skipped at their defaults: `trainer_settings`), to TRL's typed
flags (infra/command_line.py calls the pieces), and to a GRPOConfig object passed to train() (`unset_keys_dropped`).

- TRL's batch keys become --batch-size and --updates-per-iteration as TRL derives its generation batch
  (`trl_batch`, `trl_batch_options`); its step counts, optimizer steps, become --iterations, --save-every and
  --eval-every (`trl_steps`); its switches (bf16 false, use_cpu true) become --dtype float32 and --device cpu
  (`switch_taken`, `switch_line`); its model_init_kwargs become --dtype and --attn-implementation
  (`model_init_options`).
- What is ignored is said in one line (`unused_line`); what is refused, in one line naming what to use instead
  (`fixed_refusal`); our defaults that change what a run learns, when a TRL file leaves them at ours
  (`departures_line`).
"""
from __future__ import annotations

import dataclasses
import math
import os

from infra.trl_names import (DERIVED_AT_NULL, DEPARTURES, STEP_STRATEGIES, TRL_ALIASES, TRL_BATCH_KEYS, TRL_DIFFERENT,
                             TRL_FIXED, TRL_STEP_KEYS, TRL_STEPS, TRL_SWITCHES, TRL_UNUSED, VLLM_KEYS)


def switch_taken(key: str, given: set[str]) -> bool:
    """Whether TRL's switch `key` may set its option (TRL_SWITCHES): neither that option, under our name or TRL's,
    nor the switch itself is in `given`."""
    option = TRL_SWITCHES[key][1]
    return not ({option, key} | {trl for trl, ours in TRL_ALIASES.items() if ours == option}) & given


def switch_line(key: str, typed: bool) -> str:
    """The line a TRL switch taken as our option gets: "took TRL's bf16 false as --dtype float32 (...)", typed
    "--bf16 false" ("--use-cpu" for a switch taken when true)."""
    when, option, value, why = TRL_SWITCHES[key]
    name = f"--{key.replace('_', '-')}" + ("" if when else " false") if typed else f"{key} {str(when).lower()}"
    return f"took TRL's {name} as --{option.replace('_', '-')} {value}{why}"


RESOLVED_AT_INIT = ("disable_tqdm", "accelerator_config", "bf16")  # None in the class, set by __post_init__ if unset


def unset_keys_dropped(values: dict, defaults: dict, known: set[str]) -> dict:
    """A GRPOConfig object's `values` (its to_dict()) less the keys `trl_keys` would only ignore that are at the
    class's `defaults`: TRL_UNUSED ones, TRL_FIXED ones, DERIVED_AT_NULL ones at null, transformers' TrainingArguments
    settings not `known` as options. What the user did not set then says nothing (a GRPOConfig holds ~150 keys);
    what they set is still taken, ignored with a line, or refused.

    >>> unset_keys_dropped({"logging_strategy": "steps", "push_to_hub": True, "beta": 0.0},
    ...                    {"logging_strategy": "steps", "push_to_hub": False, "beta": 0.0}, {"beta"})
    {'push_to_hub': True, 'beta': 0.0}
    """
    trainer_only = trainer_settings([key for key in values if key not in known and key not in TRL_DIFFERENT
                                     and key not in TRL_STEP_KEYS and key not in TRL_BATCH_KEYS])

    def only_ignored(key: str, value) -> bool:
        return (key in TRL_UNUSED or key in TRL_FIXED and is_fixed_value(key, value)
                or key in DERIVED_AT_NULL and value is None or key in trainer_only)

    def unset(key: str, value) -> bool:  # to_dict() writes some None as [], resolves some, and hides tokens
        default = defaults.get(key, ...)
        return key in defaults and (value == default and isinstance(value, bool) == isinstance(default, bool)
                                    and (value is None) == (default is None)  # (0 == False == 0.0; None is none)
                                    or default in (None, "") and value in ([], {})
                                    or default is None and key in RESOLVED_AT_INIT
                                    or key.endswith("_token") and value == f"<{key.upper()}>")
    kept = {key for key, (when, *_) in TRL_SWITCHES.items() if values.get(key) is when}  # taken as our options
    if values.get("eval_strategy") == "steps" and values.get("eval_steps") is None:  # eval_steps unset: every
        kept.add("logging_steps")                                                     # logging_steps
    return {key: value for key, value in values.items()
            if key in kept or not (unset(key, value) and only_ignored(key, value))}


MODEL_INIT_OPTIONS = {"torch_dtype": "dtype", "dtype": "dtype", "attn_implementation": "attn_implementation"}


def model_init_options(kwargs: dict, given: set[str], note) -> dict:
    """TRL's model_init_kwargs (from_pretrained's keywords) as our options: dtype (torch_dtype) and
    attn_implementation, unless given; ValueError naming any other keyword (no option loads models otherwise).

    >>> model_init_options({"torch_dtype": "bfloat16"}, set(), print)
    took TRL's model_init_kwargs torch_dtype 'bfloat16' as --dtype bfloat16
    {'dtype': 'bfloat16'}
    """
    other = [key for key in kwargs if key not in MODEL_INIT_OPTIONS]
    if other:
        raise ValueError(f"model_init_kwargs: {', '.join(other)}: models load with --dtype and --attn-implementation "
                         "only (no option passes other keywords to from_pretrained)")
    options = {}
    for key, value in kwargs.items():
        option = MODEL_INIT_OPTIONS[key]
        if option not in given and option not in options and value is not None:
            options[option] = str(value).removeprefix("torch.")  # torch.bfloat16 written as a string too
            note(f"took TRL's model_init_kwargs {key} {value!r} as --{option.replace('_', '-')} {options[option]}")
    return options


def is_fixed_value(key: str, value) -> bool:
    """Whether a --config file's `value` for TRL's `key` is what this trainer does (`TRL_FIXED`): numbers compared as
    numbers (YAML reads 1e-8 as a string), booleans as booleans.

    >>> is_fixed_value("adam_epsilon", "1e-8"), is_fixed_value("adam_beta1", False), is_fixed_value("fp16", 0)
    (True, False, False)
    """
    def number(x):
        if isinstance(x, bool) or not isinstance(x, (int, float, str)):
            return None
        try:
            return float(x)
        except ValueError:
            return None
    return any(type(value) is type(fixed) and value == fixed or isinstance(fixed, (int, float))
               and not isinstance(fixed, bool) and number(value) is not None and number(value) == fixed
               for fixed in TRL_FIXED[key][0])


def trl_batch(values: dict, processes: int) -> tuple[int, int, str, str]:
    """(--batch-size, --updates-per-iteration, and TRL's products that give each, in words) for TRL's batch keys
    in `values` (TRL_BATCH_KEYS; TRL's defaults for those missing: 8 per device, 1 accumulation step, the two others
    derived) on `processes` training processes, as GRPOConfig.__post_init__ derives them: a generation batch of
    B = per_device x processes x steps_per_generation completions (steps_per_generation defaults to
    gradient_accumulation_steps), of which each optimizer step takes per_device x processes x
    gradient_accumulation_steps: steps_per_generation / gradient_accumulation_steps steps per batch. ValueError
    where TRL refuses too, or the steps do not divide.

    >>> trl_batch({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}, 1)[:2]
    (32, 1)
    >>> trl_batch({"per_device_train_batch_size": 8, "steps_per_generation": 4}, 2)[:2]
    (64, 4)
    """
    per_device = values.get("per_device_train_batch_size", 8)
    accumulation = values.get("gradient_accumulation_steps", 1)
    steps, batch = values.get("steps_per_generation"), values.get("generation_batch_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (per_device, accumulation, *(v for v in (steps, batch) if v is not None))):
        raise ValueError(f"TRL's {', '.join(key for key in TRL_BATCH_KEYS if key in values)} must be positive whole "
                         "numbers")
    per_step = per_device * processes  # completions per micro-step, all processes
    if steps is not None and batch is not None:  # GRPOConfig.to_dict() writes both, as its __post_init__ derived them
        if batch != per_step * steps:
            raise ValueError(f"steps_per_generation {steps} and generation_batch_size {batch} are both set and "
                             f"disagree (per_device_train_batch_size {per_device} x {processes} process(es) x "
                             f"{steps} = {per_step * steps}; TRL refuses both set): keep one")
        batch = None
    if batch is not None and batch % per_step:
        raise ValueError(f"generation_batch_size {batch} is not a multiple of per_device_train_batch_size {per_device} "
                         f"x {processes} process(es) (TRL refuses it too)")
    steps = steps or (batch // per_step if batch is not None else accumulation)
    if steps % accumulation:
        raise ValueError(f"steps_per_generation {steps} is not a multiple of gradient_accumulation_steps "
                         f"{accumulation}: each optimizer step here takes a whole share of the batch; give "
                         "--batch-size and --updates-per-iteration")
    batch, updates = per_device * processes * steps, steps // accumulation
    return (batch, updates,
            f"TRL's per_device_train_batch_size {per_device} x {processes} process(es) x steps_per_generation {steps}",
            f"{steps} / gradient_accumulation_steps {accumulation}")


def trl_batch_options(trl_batch_keys: dict, values: dict, skip: set[str], note, group_size: int) -> dict:
    """{batch_size, updates_per_iteration} from TRL's batch keys (`trl_batch`, on WORLD_SIZE processes), where a
    --config file or the command line gives them: none when --batch-size is given (`values` or `skip`, the typed
    options), no updates_per_iteration when that is given; said in one `note` line. ValueError with the reason
    where TRL refuses, with --inference-ranks, or where the batch does not split into whole groups."""
    if "batch_size" in values or "batch_size" in skip:
        note(f"ignored TRL's {', '.join(trl_batch_keys)}: --batch-size is given")
        return {}
    if values.get("inference_ranks") or "inference_ranks" in skip:
        raise ValueError(f"{', '.join(trl_batch_keys)}: with --inference-ranks give --batch-size (the responses "
                         "sampled per iteration, all trainer ranks together) instead")
    batch, updates, batch_from, updates_from = trl_batch(trl_batch_keys, int(os.environ.get("WORLD_SIZE", "1")))
    group = values.get("num_generations", values.get("group_size", group_size))
    checked = "group_size" not in skip and isinstance(group, int)  # a typed --group-size is checked later
    if checked and batch % group:
        raise ValueError(f"{batch_from} = {batch} completions per batch, not a multiple of num_generations {group} "
                         "(TRL refuses it too)")
    line, options = f"took {batch_from} as --batch-size {batch} (TRL's generation batch)", {"batch_size": batch}
    if "updates_per_iteration" in values or "updates_per_iteration" in skip:
        line += " (--updates-per-iteration is given)"
    elif checked and (batch // group) % updates:
        raise ValueError(f"{batch_from} = {batch} completions = {batch // group} groups of num_generations "
                         f"{group}, which {updates} optimizer steps cannot share as whole groups: give "
                         "--batch-size and --updates-per-iteration")
    else:
        line += (f" and {updates_from} as --updates-per-iteration {updates}; the size of a forward is "
                 "--micro-batch-tokens")
        options["updates_per_iteration"] = updates
    note(line)
    return options


def trainer_settings(keys: list[str]) -> dict:
    """{key: its default} for those of `keys` that are fields of transformers' TrainingArguments (the settings of its
    Trainer, under GRPOConfig), read from the installed transformers; {} if none (transformers is then not imported).

    >>> trainer_settings(["do_eval", "max_new_tokens"])
    {'do_eval': False}
    """
    if not keys:
        return {}
    from transformers import TrainingArguments
    fields = {field.name: field for field in dataclasses.fields(TrainingArguments)}
    return {key: (fields[key].default if fields[key].default is not dataclasses.MISSING
                  else fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING
                  else None) for key in keys if key in fields}


def trl_keys(values: dict, skip: set[str], note, known: set[str], group_size: int, typed_batch: dict | None = None,
             refusals: list[str] | None = None, steps: dict | None = None) -> dict:
    """A --config file's `values` (keys spelled with _) with TRL's and transformers' keys dealt with, the rest returned
    (our options, TRL's aliases for them, and whatever is unknown, which the caller refuses). In order:
    TRL_FIXED keys at another value are refused; TRL_UNUSED keys, TRL_FIXED ones at their value and DERIVED_AT_NULL
    ones at null are dropped, named in one `note` line; TRL's batch keys become
    --batch-size and --updates-per-iteration (`trl_batch`, on WORLD_SIZE processes), with those typed on the
    command line (`typed_batch`; each wins over the file's), unless --batch-size is given (`skip`: the options
    typed); transformers' TrainingArguments keys not `known` here, and TRL_DIFFERENT ones, are dropped at their
    defaults with a line and refused at another value. Each refusal's reason is appended to `refusals` (all of a
    file's at once, not one per run), or, without that list, raised as ValueError. TRL's step counts and their
    strategies (TRL_STEP_KEYS) go to `steps`, for `trl_steps` once the run's optimizer steps per iteration are known."""
    pending: list[str] = [] if refusals is None else refusals
    trls = [key for key in values if key not in known or key in TRL_ALIASES]  # the file is TRL's if it has these
    steps = {} if steps is None else steps  # TRL's step counts, read once the optimizer steps per iteration are known
    steps.update({key: values[key] for key in TRL_STEP_KEYS if key in values})
    if ("eval_steps" in steps or "eval_strategy" in steps) and "logging_steps" in values:  # eval_steps unset: every
        # logging_steps, as transformers reads it
        steps["logging_steps"] = values["logging_steps"]
    values = {key: value for key, value in values.items() if key not in TRL_STEP_KEYS}
    if isinstance(values.get("model_init_kwargs"), dict):  # TRL's from_pretrained keywords: those that are options
        values = {**model_init_options(values["model_init_kwargs"], set(values) | set(skip), note), **{
            key: value for key, value in values.items() if key != "model_init_kwargs"}}
    fixed = [key for key, value in values.items() if key in TRL_FIXED and not is_fixed_value(key, value)]
    pending += [fixed_refusal(key, values[key]) for key in fixed]
    values = {key: value for key, value in values.items() if key not in fixed}
    if values.get("torch_compile") is True and "gradient_checkpointing" not in skip and (
            values.get("gradient_checkpointing") or values.get("activation_checkpointing")):  # (typed: that value
        # decides; typed on beside it, both were asked for: validate's one line)
        values = {key: value for key, value in values.items() if key != "torch_compile"}  # (TRL's default is on)
        note("ignored TRL's torch_compile true: gradient_checkpointing is on, whose recomputation runs the layers "
             "eagerly (set gradient_checkpointing false to compile them: --compile-train on)")
    for key, (when, option, value, _) in TRL_SWITCHES.items():  # use_cpu true, bf16 false: our options
        if values.get(key) is when and switch_taken(key, set(values) - {key} | set(skip)):
            values = {option: value, **{name: v for name, v in values.items() if name != key}}
            note(switch_line(key, typed=False))
    unused = {key: value for key, value in values.items()
              if key in TRL_UNUSED or key in TRL_FIXED or key in DERIVED_AT_NULL and value is None}
    if unused:
        note(unused_line(unused))
    values = {key: value for key, value in values.items() if key not in unused}
    trl_batch_keys = {**{key: values.pop(key) for key in TRL_BATCH_KEYS if key in values}, **(typed_batch or {})}
    if trl_batch_keys:
        values = {**trl_batch_options(trl_batch_keys, values, skip, note, group_size), **values}
    trainer_only = trainer_settings([key for key in values if key not in known])
    if trainer_only:  # transformers' TrainingArguments, for its Trainer: at their defaults they change nothing here
        at_default = [key for key in trainer_only if trainer_only[key] == values[key]
                      or values[key] in (None, "", [], {}) and trainer_only[key] in (None, "", [], {})]
        changed = [key for key in trainer_only if key not in at_default and key not in TRL_DIFFERENT]
        pending += [f"{key}: {values[key]!r} is a setting of transformers' Trainer, which this trainer does not use "
                    "(no equivalent here)" for key in changed]  # a TRL_DIFFERENT one: refused by the caller
        if at_default:  # a whole TrainingArguments written out: ~90 keys, counted rather than named
            named = ", ".join(at_default) if len(at_default) <= SAY_WHY_UP_TO else f"{len(at_default)} keys"
            note(f"ignored transformers' TrainingArguments {named}: at their defaults, which change nothing here (this "
                 "trainer does not use transformers' Trainer)")
        values = {key: value for key, value in values.items() if key not in at_default and key not in changed}
    if pending and refusals is None:
        raise ValueError("; ".join(pending))
    if trls and not pending:  # a file that runs: what it runs with
        line = departures_line({TRL_ALIASES.get(key, key) for key in values} | set(skip)
                               | ({"batch_size"} if trl_batch_keys else set()) | steps_set(steps))
        if line:
            note(line)
    return values


def number_of_steps(key: str, value) -> int | float:
    """A TRL step count given as a number or typed as text (`--max-steps 100`); ValueError if it is neither.

    >>> number_of_steps("save_steps", "0.25"), number_of_steps("max_steps", 100)
    (0.25, 100)
    """
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    if value is True:  # typed alone: --max-steps
        raise ValueError(f"--{key.replace('_', '-')} needs a number of optimizer steps")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} takes a number of optimizer steps (got {value!r})")
    return int(value) if isinstance(value, float) and value >= 1 and value == int(value) else value


def is_false(value) -> bool:
    """Whether a TRL switch's `value` (a --config file's boolean, or the text typed after the flag) is false.

    >>> is_false(False), is_false("False"), is_false(True), is_false(None)
    (True, True, False, False)
    """
    return value is False or isinstance(value, str) and value.lower() in ("false", "0", "no")


def steps_set(steps: dict) -> set[str]:
    """Our options that TRL's step keys in `steps` (TRL_STEP_KEYS) set, for `departures_line`.

    >>> sorted(steps_set({"max_steps": -1, "save_steps": 50, "eval_strategy": "no"}))
    ['eval_every', 'save_every']
    """
    return ({"iterations"} if steps.get("max_steps") not in (None, -1) else set()) | {
        ours for key, ours in TRL_STEPS.items() if key in STEP_STRATEGIES and (
            key in steps or STEP_STRATEGIES[key] in steps)} | ({"eval_every"} if is_false(steps.get("do_eval"))
                                                                else set())


def trl_steps(steps: dict, updates: int, passes: int, note) -> dict:
    """Our {iterations, save_every, eval_every} from TRL's step counts in `steps` (TRL_STEP_KEYS, and logging_steps),
    which count optimizer steps: an iteration here takes updates x passes of them (--updates-per-iteration x
    --num-iterations, as TRL's generation batch takes steps_per_generation / gradient_accumulation_steps x
    num_iterations). Each translation is said in one `note` line; ValueError with the reason where there is none.

    - max_steps above 0 (transformers' -1: unset) is --iterations max_steps / (updates x passes); a count that is not
      whole is refused, naming the two nearest that are: the run, and its learning-rate schedule, would not be TRL's.
    - save_strategy 'steps' (transformers' default, where only save_steps is given) with save_steps (default 500),
      and eval_strategy 'steps' with eval_steps (default: logging_steps, TRL's 10), are --save-every and --eval-every,
      rounded up to whole iterations: a checkpoint or an evaluation comes at an iteration's end. Strategy 'no' is 0;
      eval_strategy 'epoch' is --eval-every-epoch (once per pass over the training prompts); save_strategy 'epoch',
      'best', and a fraction of the run's steps, are refused.
    - do_eval false with eval_strategy unset (transformers' 'no') is --eval-every 0: TRL would not evaluate. (Where
      eval_strategy is not 'no', transformers sets do_eval true: the strategy decides.)

    >>> trl_steps({"max_steps": 100, "save_steps": 30, "eval_strategy": "no"}, 2, 2, lambda line: None)
    {'iterations': 25, 'save_every': 8, 'eval_every': 0}
    """
    per_iteration, options = updates * passes, {}
    each = (f"{per_iteration} optimizer steps each (--updates-per-iteration {updates} x --num-iterations {passes})"
            if per_iteration > 1 else "1 optimizer step each")
    total = number_of_steps("max_steps", steps.get("max_steps", -1))
    if total != -1 and (not isinstance(total, int) or total < 1):
        raise ValueError(f"max_steps must be a whole number of optimizer steps above 0, or -1 (got {total!r})")
    if total != -1 and total % per_iteration:
        below, above = total // per_iteration * per_iteration, -(-total // per_iteration) * per_iteration
        raise ValueError(f"max_steps {total} is not a whole number of iterations of {each}: give max_steps "
                         + (f"{below} or {above}" if below else f"{above}") + ", or --iterations")
    if total != -1:
        options["iterations"] = total // per_iteration
        note(f"took TRL's max_steps {total} as --iterations {total // per_iteration}, of {each}")
    for key, strategy_key in STEP_STRATEGIES.items():
        ours = TRL_STEPS[key]
        default_strategy = "steps" if key == "save_steps" and key in steps else None  # transformers' default
        strategy = steps.get(strategy_key, default_strategy)
        option = f"--{ours.replace('_', '-')}"
        if strategy is None and key == "eval_steps" and is_false(steps.get("do_eval")):  # TRL's eval_strategy 'no'
            options[ours] = 0
            note(f"took TRL's do_eval false, with eval_strategy unset (TRL's 'no'), as {option} 0")
            continue
        if strategy is None:
            if steps.get(key) is not None:
                note(f"ignored TRL's {key}: TRL reads it only with {strategy_key} 'steps'")
            continue
        if strategy in ("no", False):  # False: YAML 1.1 reads an unquoted no as false
            options[ours] = 0
            note(f"took TRL's {strategy_key} 'no' as {option} 0")
            continue
        if strategy == "epoch" and key == "eval_steps":  # once the data is read: launch/start.prepare
            options["eval_every_epoch"] = True
            note(f"took TRL's {strategy_key} 'epoch' as --eval-every-epoch: an evaluation after each pass over the "
                 "training prompts")
            continue
        if strategy != "steps":
            raise ValueError(f"{strategy_key} {strategy!r} is not what this trainer does ({option} N: every N "
                             f"iterations, each θ_k's batch): use {option} N, or {strategy_key} 'steps' with {key}")
        count, default = steps.get(key), ""
        if count is None:  # transformers' defaults: save_steps 500; eval_steps those of logging_steps (TRL's 10)
            count = 500 if key == "save_steps" else steps.get("logging_steps", 10)
            default = " (TRL's default" + (")" if key == "save_steps" else ": logging_steps)")
        count = number_of_steps(key, count)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"{key} {count} " + ("(a fraction of the run's steps) has no equivalent here: give "
                                                 if 0 < count < 1 else "is not a number of optimizer steps: give ")
                             + f"{option} N, every N iterations")
        options[ours] = -(-count // per_iteration)
        note(f"took TRL's {strategy_key} 'steps', {key} {count}{default} as {option} {options[ours]}, of {each}"
             + (f" ({key} {count} falls inside an iteration: rounded up to its end)" if count % per_iteration
                else ""))
    return options


# DEPARTURES that change what a run learns or what it costs: said when a TRL config file leaves them at ours
RESULT_DEPARTURES = ("--iterations", "--beta", "--seed", "--disable-dropout", "--gradient-checkpointing",
                     "--eval-every", "--save-every", "--batch-size")


def departures_line(given: set[str]) -> str | None:
    """For a TRL config file: which of this trainer's defaults that differ from TRL's (RESULT_DEPARTURES) apply,
    because neither the file nor the command line sets them (`given`: option names, with _); None if none do.

    >>> departures_line({"beta", "seed", "disable_dropout", "gradient_checkpointing", "eval_every", "batch_size",
    ...                  "num_train_epochs"})
    "defaults of this trainer that are not TRL's and that it leaves unset: --save-every 0 (never) (TRL: ...)..."
    """
    given = set(given) | ({"iterations"} if "num_train_epochs" in given else set())  # either sets the run's length
    left = [(option, ours, theirs) for option, ours, theirs, _ in DEPARTURES
            if option in RESULT_DEPARTURES and option[2:].replace("-", "_") not in given]
    if not left:
        return None
    return ("defaults of this trainer that are not TRL's and that it leaves unset: "
            + ", ".join(f"{option} {ours} (TRL: {theirs})" for option, ours, theirs in left)
            + "; set them to have TRL's (--help's end says why each differs)")


def fixed_refusal(key: str, value) -> str:
    """The line a --config file's TRL `key` at a `value` this trainer does not do gets (`TRL_FIXED`)."""
    _, does, instead = TRL_FIXED[key]
    return f"{key}: {value!r} is not what this trainer does ({does}): " + (f"use {instead}" if instead else
                                                                            "no option changes it")


SAY_WHY_UP_TO = 8  # unused_line gives each key's reason for at most this many keys
ALWAYS_SAID = ("overwrite_output_dir",)  # its reason is given among any number of keys (true: the run may stop there)


def unused_line(values: dict) -> str:
    """The line a --config file with TRL's keys for what has no use here (`TRL_UNUSED`) or at what this trainer does
    (`TRL_FIXED`) gets, from those keys and their values.

    >>> unused_line({"logging_steps": 5})
    "ignored TRL's logging_steps: every iteration is logged (a line and a metrics.jsonl row, sent to --report-to)"
    >>> unused_line({"use_vllm": False})
    "ignored TRL's use_vllm False: sampling runs in this trainer's own engine and processes"
    >>> unused_line({"hub_strategy": "end", "hub_private_repo": True})[:70]
    "ignored TRL's hub_strategy, hub_private_repo: nothing is pushed (push_"

    More than SAY_WHY_UP_TO keys (a whole GRPOConfig file: ~50) are named without their reasons, vLLM's as vllm_*:
    the line stays readable, and each reason is in TRL_UNUSED, TRL_FIXED and DERIVED_AT_NULL here.
    """
    if len(values) > SAY_WHY_UP_TO:  # ALWAYS_SAID keys matter (true: the run may stop there): said as one
        read_as = {key: value for key, value in values.items() if key in ALWAYS_SAID and value}
        vllm = [key for key in values if key in VLLM_KEYS]
        names = [key for key in values if key not in VLLM_KEYS and key not in read_as]
        names += [f"vllm_* ({len(vllm)} key{'s' if len(vllm) > 1 else ''})"] if vllm else []
        return (f"ignored {len(values) - len(read_as)} of TRL's keys, each at a value that changes nothing here or "
                f"for what this trainer has no use: {', '.join(names)} (why, for each: infra/trl_names.py; a file "
                f"with {SAY_WHY_UP_TO} or fewer of them says it)"
                + (f"; {unused_line(read_as)[len('ignored '):]}" if read_as else ""))
    reasons: dict[str, list[str]] = {}  # a reason -> the keys it answers (keys that share one are named together)
    for key, value in values.items():
        if key in DERIVED_AT_NULL and value is None:
            reasons.setdefault(f"null, derived here too, from {DERIVED_AT_NULL[key]}", []).append(key)
        elif key in TRL_UNUSED:
            reasons.setdefault(TRL_UNUSED[key], []).append(key)
        else:
            reasons.setdefault(TRL_FIXED[key][1], []).append(f"{key} {value!r}")
    return "ignored TRL's " + "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in reasons.items())
