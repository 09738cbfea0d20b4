"""The command line read into a Config: a --config file's options placed before the typed ones, TRL's flags made
ours, then parsed, validated and derived (infra/options.py: the parser, `validate`, `derive`).

    parse_args(argv) = derive(cfg),  cfg = Config(parser(with_config_file(argv))),  refused if validate(cfg) names a
                                     problem (one line, exit 2)

`--config FILE`: a JSON file (`.json`) or YAML (anything else; PyYAML, which transformers requires) holding
a mapping from option names (Config's field names: `max_new_tokens` for --max-new-tokens) to values; the
shape of config.json is accepted (its run_id, versions and command are skipped). The file's options become
command-line flags placed before the command line's own (`with_config_file`), so argparse checks them as it
checks typed ones and the command line wins (argparse keeps an option's last value; a list option given
on the command line, such as --reward, replaces the file's instead of adding to it, and an option a run record
(config.json) holds as derived from one given anew is derived again: `DERIVED_FROM`; under torchrun each rank
places its own devices); they count as given:
with --resume a result-changing one that differs from the checkpoint's is refused, like a typed flag.

Departure, on purpose: `resume`, `overwrite` and `config` in a file are skipped; they act on what --out
already holds, so they are read from the command line only (a rerun of a config.json that was written with
--overwrite must not delete a run by itself). So are a run record's `out` and `trace` (`RUN_OUTPUTS`; a config.json,
which has a run_id): a rerun writes a folder and a trace of its own unless --out and --trace are given.

TRL's command line and files (infra/trl_names.py, infra/trl_config.py). TRL's batch keys (per_device_train_batch_size,
gradient_accumulation_steps, ...), typed or in a file, become the --batch-size and --updates-per-iteration TRL's
generation batch makes (`with_config_file`), and TRL's step counts (max_steps, save_steps, eval_steps: optimizer
steps) the --iterations, --save-every and --eval-every they make (`trl_step_flags`). A key for what this trainer has
no use for (logging_steps, push_to_hub, bf16, run_name, ...: `TRL_UNUSED`) is ignored with one line saying why, typed
or in a --config file, so that a TRL command line or config file runs as it is; one for what this trainer does one
way only, at a value that is that way (use_vllm false, fp16 false, optim adamw_torch, adam_beta2 0.999, ...:
`TRL_FIXED`; another value is refused in one line naming what to use), is ignored with a line, typed or in a file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from config import SIZE_FIELDS, Config, is_model_name
from infra.options import (BOOL_WORDS, build_parser, closest_name, derive, unknown_option, validate,
                           with_new_names)
from infra.data import BUILT_IN_TASKS
from infra.outputs import trained_policy
from infra.trl_config import (is_fixed_value, number_of_steps, switch_line, switch_taken, trl_batch_options, trl_keys,
                              trl_steps)
from infra.trl_names import (STEP_STRATEGIES, TRL_ALIASES, TRL_BATCH_KEYS, TRL_DIFFERENT, TRL_FIXED, TRL_STEP_KEYS,
                             TRL_STEPS, TRL_SWITCHES, TRL_UNUSED)

NOT_OPTIONS = ("run_id", "versions", "command")  # config.json's keys that are not options (run_id marks a record)
COMMAND_LINE_ONLY = ("resume", "overwrite", "config")  # read from the command line only (module docstring)
# Options config.json records as `derive` resolved them from another option: given anew on the command line, that
# option re-derives them (a tiny run's config.json with --model qwen2.5-0.5b must not keep the tiny lr and lengths).
DERIVED_FROM = {"model": ("lr", "max_new_tokens", "eval_samples", *SIZE_FIELDS), "reward": ("reward_weights",),
                "device": ("train_device", "rollout_device", "dtype", "pad_to_multiple_of", *SIZE_FIELDS),
                "mode": ("rollout_device", *SIZE_FIELDS),
                "batch_size": SIZE_FIELDS, "group_size": SIZE_FIELDS,
                "inference_workers": ("rollout_device", *SIZE_FIELDS), "eval_every": ("eval_size",),
                **dict.fromkeys(("data", "split", "eval_split"), ("eval_size",))}  # auto: a fifth of small data
# A run record's options that name that run's outputs: a rerun of its config.json writes its own (unless given anew)
RUN_OUTPUTS = ("out", "trace")


def normalized(argv: list[str]) -> list[str]:
    """argv with `--name_with_underscores` as `--name-with-underscores` (TRL's parser accepts both spellings)."""
    def spelled(token: str) -> str:
        if not token.startswith("--"):
            return token
        name, sep, value = token.partition("=")
        return name.replace("_", "-") + sep + value
    return [spelled(token) for token in argv]


def values_of(namespace: argparse.Namespace) -> dict:
    """The parsed options (argparse's namespace less the parser's own marks, such as `_epsilon_high_given`)."""
    return {name: value for name, value in vars(namespace).items() if not name.startswith("_")}


def given_options(argv: list[str] | None = None) -> set[str]:
    """The fields named on the command line, not left at their defaults (a resumed run tells them apart); the
    options of a --config file count as named."""
    return set(given_values(argv))


def given_values(argv: list[str] | None = None) -> dict:
    """`given_options` with their values as typed (--model runs/latest before the link is followed)."""
    return values_of(build_parser(defaults=False).parse_args(with_config_file(argv)))


def named_twice(argv: list[str]) -> list[str]:
    """The flags of the first option the command line names by two names, TRL's and ours (TRL_ALIASES), else [].

    >>> named_twice(["--learning_rate", "1e-4", "--lr=2e-4", "--lr", "3e-4"]), named_twice(["--lr", "1", "--lr", "2"])
    (['--learning-rate', '--lr'], [])
    """
    names: dict[str, list[str]] = {}  # field -> the flags naming it, in order
    for token in normalized(argv):
        if token == "--":
            break
        flag = token.partition("=")[0]
        key = flag[2:].removeprefix("no-").replace("-", "_") if flag.startswith("--") else None
        if key is not None and "--" + key.replace("_", "-") not in names.setdefault(TRL_ALIASES.get(key, key), []):
            names[TRL_ALIASES.get(key, key)].append("--" + key.replace("_", "-"))
    return next((flags for flags in names.values() if len(flags) > 1), [])


def parse_args(argv: list[str] | None = None, prog: str = "trainer.py") -> Config:
    """Parse (a --config file's options first, the command line's after them), validate and derive; on invalid
    input print one line and exit with code 2."""
    args = build_parser(prog).parse_args(with_config_file(argv, prog, say=True))
    cfg = Config(**values_of(args))
    problems = validate(cfg)
    if twice := named_twice(sys.argv[1:] if argv is None else argv):
        problems.insert(0, f"{' and '.join(twice)} name the same option, TRL's name and ours: give one")
    if cfg.num_train_epochs is not None and "iterations" in given_options(argv):
        problems.insert(0, f"--num-train-epochs {cfg.num_train_epochs:g} and --iterations {cfg.iterations} both set "
                           "the run's length: give one")
    try:
        policy = trained_policy(cfg.model) if cfg.model.strip() else None  # a run's or a checkpoint's folder: its model
    except ValueError as error:
        policy = None
        problems.insert(0, str(error))
    model = Path(os.path.expanduser(cfg.model)).resolve()
    inside = (cfg.out and cfg.model.strip() and not is_model_name(cfg.model) and model.exists()
              and Path(cfg.out).resolve() in (model, *model.parents))
    if cfg.overwrite and inside:
        problems.insert(0, f"--model {cfg.model} is in --out {cfg.out}, whose run --overwrite deletes before the "
                           "model loads: choose another --out")
    if problems:
        sys.stderr.write(f"{prog}: error: {problems[0]}\n")
        raise SystemExit(2)
    lora = sorted(name for name in given_options(argv) if name.startswith("lora_"))
    if lora and not cfg.use_peft and os.environ.get("RANK", "0") == "0":  # TRL ignores them too: a line, no error
        print(f"periodic-rl: ignored {', '.join('--' + name.replace('_', '-') for name in lora)}: the LoRA adapter's "
              "settings, and --use-peft is off: every weight is trained (add --use-peft to train an adapter)",
              flush=True)
    cfg = derive(cfg if policy is None else from_trained_policy(cfg, policy))
    data = cfg.data or cfg.default_data
    dataset = sorted(name for name in given_options(argv) if name in DATASET_OPTIONS)
    if dataset and data in BUILT_IN_TASKS and os.environ.get("RANK", "0") == "0":  # no splits or columns to choose
        print(f"periodic-rl: ignored {', '.join('--' + name.replace('_', '-') for name in dataset)}: options of a "
              f"dataset (a file, a folder or a hub id), and --data {data} is built in", flush=True)
    return cfg


DATASET_OPTIONS = ("data_config", "split", "eval_split", "answer_column")  # not --prompt-column: --text-prompts uses it


def from_trained_policy(cfg: Config, policy: Path) -> Config:
    """`cfg` with --model the trained `policy` (outputs.trained_policy: resolved, as runs/latest moves on) and the
    options its run had that `derive` would fill from the model's name (`trained_with`), said in one line on rank 0
    when --model named the run's folder or something was taken."""
    taken = trained_with(cfg, policy)
    said = ("".join(f", --{key.replace('_', '-')} {value}" for key, value in taken.items())
            + " (the defaults its run had, not given)" if taken else "")
    line = (f"a run's folder: took its trained policy, {policy}{said}"
            if policy != Path(os.path.expanduser(cfg.model)).resolve() else
            f"a run's trained policy: took{said[1:]}" if taken else "")
    if line and os.environ.get("RANK", "0") == "0":
        print(f"periodic-rl: --model {cfg.model}: {line}", flush=True)
    return dataclasses.replace(cfg, model=str(policy), **taken)


def trained_with(cfg: Config, policy: Path) -> dict:
    """The options `derive` fills from the model's name (--data, --lr, --max-new-tokens), not given in `cfg`, at the
    values of the run that trained `policy` (its config.json, or its checkpoint's state.json): a run started from a
    tiny run's policy goes on with its task and rate, not with gsm8k and 1e-6 (the defaults of a model not tiny)."""
    state = policy.parent / "state.json"
    try:
        options = (json.loads(state.read_text())["config"] if state.is_file()
                   else json.loads((policy.parent / "config.json").read_text()))
        source = Config(model=options["model"], data=options.get("data"))
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    taken = {"data": options.get("data") or source.default_data, "lr": options.get("lr"),
             "max_new_tokens": options.get("max_new_tokens")}
    return {key: value for key, value in taken.items() if getattr(cfg, key) is None and value is not None}


# --- --config FILE ---
def config_file(argv: list[str]) -> str | None:
    """The --config path on the command line (its last one, as argparse takes it), or None."""
    finder = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    finder.add_argument("--config")
    try:
        return finder.parse_known_args(normalized(argv))[0].config
    except argparse.ArgumentError:  # `--config` without a path: trainer.py's own parser says so
        return None


def config_source(path: str) -> str:
    """How the lines about a --config file name it: "train's args" for the file python_args.args_file wrote for
    `trainer.train(args=...)` (the user never saw it), else "--config PATH"."""
    from infra.outputs import cache_root  # (a light import)
    return "train's args" if Path(path).parent == cache_root() / "configs" else f"--config {path}"


def known_keys() -> set[str]:
    """The keys a --config file may hold as options: Config's fields, a run record's own, TRL's aliases of ours."""
    return {field.name for field in dataclasses.fields(Config)} | set(NOT_OPTIONS) | set(TRL_ALIASES) | {"epsilon"}


def file_arguments(path: str, skip: set[str] = frozenset(), note=lambda line: None,
                   typed_batch: dict | None = None, typed_steps: dict | None = None,
                   steps: dict | None = None, rederived: set[str] = frozenset()) -> list[str]:
    """The options in the JSON or YAML file `path` as command-line flags, but those in `skip` (and a run record's
    `RUN_OUTPUTS`: a rerun writes its own); ValueError with the reason if it cannot be read, is not a mapping, or
    names an unknown option. Keys may be TRL's names (TRL_ALIASES, epsilon) and may be spelled with - for _; TRL's
    keys for what has no use here (TRL_UNUSED) are left out, said in one line to `note`. `typed_batch`: TRL's batch
    keys typed on the command line (typed_trl_batch), translated with the file's (each typed one wins). TRL's step
    counts (max_steps, save_steps, eval_steps and their strategies) go to `steps`, for `trl_step_flags`: a max_steps
    gives way to a typed run length (--iterations, --num-train-epochs) and beats the file's num_train_epochs, as
    TRL's does; a typed --max-steps (`typed_steps`) replaces the file's run length. `rederived`: the options a run
    record (a config.json) holds as derived from one typed anew (DERIVED_FROM), skipped there to be derived again;
    another file's are what its author chose, and stay (but reward_weights, which go with the file's rewards).

    Example: {"max_new_tokens": 8, "learning_rate": 1e-4, "save": false, "report_to": ["tensorboard"], "trace": null}
             -> ["--max-new-tokens=8", "--lr=0.0001", "--no-save", "--report-to", "tensorboard"]
    """
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
    try:
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml
            values = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError, yaml.YAMLError: the parser's message names the line
        raise ValueError(f"is not valid {'JSON' if path.endswith('.json') else 'YAML'} ({error})".replace("\n", " "))
    if not isinstance(values, dict):
        raise ValueError("must hold a mapping from option names to values, e.g. {\"iterations\": 20}")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = with_new_names({str(key).replace("-", "_"): value for key, value in values.items()})
    # a run record: what derive resolved from an option typed anew is derived again; any file: the weights of its
    # rewards go with them (--reward typed anew replaces the file's list)
    skip = set(skip) | {name for name in rederived if "run_id" in values or name == "reward_weights"}
    if "run_id" in values and "text_prompts" not in values:  # a run record written before --text-prompts: text
        values["text_prompts"] = "chat"  # prompts were always in the chat template; the rerun is that run
    typed_length = (typed_steps or {}).get("max_steps")
    if typed_length == -1:  # typed TRL's "unset": the file's max_steps is not read (its num_train_epochs is)
        values.pop("max_steps", None)
    elif typed_length is not None:  # a typed --max-steps sets the run's length
        for key in ("iterations", "num_train_epochs", "max_steps"):
            values.pop(key, None)
    if values.get("max_steps") not in (None, -1) and "run_id" not in values:  # TRL's run length, in optimizer steps
        if "iterations" in skip or "num_train_epochs" in skip:  # a typed length wins
            ours = "--iterations" if "iterations" in skip else "--num-train-epochs"
            note(f"ignored TRL's max_steps {values.pop('max_steps')}: {ours}, given, sets the run's length instead")
        elif "iterations" in values:
            raise ValueError(f"max_steps {values['max_steps']} and iterations {values['iterations']} both set the "
                             "run's length: keep one")
        elif values.get("num_train_epochs") is not None:  # TRL's max_steps wins over its num_train_epochs
            note(f"ignored TRL's num_train_epochs {values.pop('num_train_epochs')}: max_steps sets the run's length, "
                 "as in TRL")
    if "iterations" in skip and values.get("num_train_epochs") is not None:  # a typed length wins, as TRL's
        values.pop("num_train_epochs")  # max_steps wins over its num_train_epochs
        note("num_train_epochs: --iterations, given, sets the run's length instead (TRL's max_steps wins over "
             "num_train_epochs too)")
    elif "num_train_epochs" in skip or "run_id" in values and values.get("num_train_epochs") is not None:
        values.pop("iterations", None)  # typed epochs win over a file's length; a record's came from its epochs
    if "gradient_checkpointing" in values and values.get("activation_checkpointing") in (
            None, values["gradient_checkpointing"]):  # transformers 5's to_dict() writes both names, the same value
        values.pop("activation_checkpointing", None)
    refusals: list[str] = []  # every refused key of the file, said in one line
    values = trl_keys(values, set(skip), note, known=known_keys(),
                      group_size=fields["group_size"].default, typed_batch=typed_batch or {}, refusals=refusals,
                      steps=steps)
    unknown = [key for key in values if key not in fields and key not in NOT_OPTIONS and key not in TRL_ALIASES
               and key != "epsilon"]
    if unknown or refusals:
        names = [*fields, *TRL_ALIASES, "epsilon"]
        refusals += [TRL_DIFFERENT.get(key) and f"{key} is TRL's and means something else here: use "
                     f"{TRL_DIFFERENT[key]}" or f"unknown option {key}" + "".join(
                         f": did you mean {close}?" for close in filter(None, [closest_name(key, names)]))
                     for key in unknown]
        raise ValueError(f"{len(refusals)} key{'s' if len(refusals) > 1 else ''} refused: " * (len(refusals) > 1)
                         + "; ".join(refusals) + (" (the keys are trainer.py's options with _ for -, e.g. "
                                                  "max_new_tokens, or TRL's names for them; see --help)" if unknown
                                                  else ""))
    named = {}  # field -> the keys naming it (ours, TRL's)
    for key in values:
        named.setdefault(TRL_ALIASES.get(key, "epsilon_low" if key == "epsilon" else key), []).append(key)
    twice = [keys for name, keys in named.items() if len(keys) > 1 and name != "epsilon_low"]
    if twice:
        raise ValueError(f"{' and '.join(twice[0])} name the same option, TRL's name and ours: keep one")
    flags, record = [], "run_id" in values
    for key, value in values.items():
        name = TRL_ALIASES.get(key, key)
        if name in NOT_OPTIONS or name in COMMAND_LINE_ONLY or name in skip or record and name in RUN_OUTPUTS:
            continue
        if name == "epsilon":  # TRL's (both ranges, unless epsilon_high is given), unless given anew
            flags += [] if "epsilon_low" in skip else [f"--epsilon={value}"]
            continue
        if key == "save_total_limit" and value is None:  # TRL's "keep all"
            value = 0
        if key == "pad_to_multiple_of" and value is None:  # TRL's "no padding"
            value = "none"
        if name in ("chat_template_kwargs", "lr_scheduler_kwargs") and isinstance(value, dict):  # the mapping
            if not value:  # TrainingArguments' {} (transformers < 5): none
                continue
            value = json.dumps(value)  # itself: the option's JSON text
        if key == "epsilon_high" and value is None:  # TRL's "the same as epsilon": ours unless given, too
            continue
        if key == "num_completions_to_print" and value is None:  # TRL's "all": ours prints none (a departure)
            note("num_completions_to_print null (TRL: print them all) is taken as this trainer's default, 0: "
                 "--log-completions keeps every completion in completions.jsonl")
            value = 0
        flag, kind = "--" + name.replace("_", "-"), fields[name].type
        if value == [] and kind.startswith("list["):  # TrainingArguments.to_dict()'s report_to 'none' (transformers 5)
            value = ["none"] if name == "report_to" else None
        if value is None and kind.startswith("list["):  # TrainingArguments' report_to null (transformers < 5): ours
            continue
        if value is None:  # an option left open: its default, which is None for every option that may be None
            if fields[name].default is not None:
                raise ValueError(f"{name}: null is not a value of {flag}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false (got {value!r})")
            flags.append(flag if value else "--no-" + flag[2:])
        elif kind.startswith("list["):
            flags += [flag, *map(str, value if isinstance(value, list) else [value])]
        elif isinstance(value, (list, dict)):
            raise ValueError(f"{name} takes one value (got {value!r})")
        else:
            flags.append(f"{flag}={value}")  # `=`: a value that starts with '-' stays a value
    return flags


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def typed_trl(argv: list[str], keys) -> tuple[dict, list[str]]:
    """(TRL's flags typed in argv for `keys`, as {TRL's key: its text, or True for a flag alone}; the rest of argv).
    A flag's value follows its `=`, or is the next token unless that is another option (--bf16 alone).

    >>> typed_trl(["--bf16", "--logging-steps", "10", "--lr", "1e-6", "--run-name=x"], TRL_UNUSED)
    ({'bf16': True, 'logging_steps': '10', 'run_name': 'x'}, ['--lr', '1e-6'])
    """
    found, rest, tokens = {}, [], list(argv)
    while tokens:
        token = tokens.pop(0)
        name, sep, value = token.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key not in keys:
            rest.append(token)
            continue
        if not sep:
            value = tokens.pop(0) if tokens and not (tokens[0].startswith("-") and not _is_number(tokens[0])) \
                else True  # --max-steps -1 takes its value; --bf16 -h does not
        found[key] = value
    return found, rest


def typed_trl_batch(argv: list[str]) -> tuple[dict, list[str]]:
    """(TRL's batch flags typed in argv, TRL_BATCH_KEYS: --per-device-train-batch-size, ..., as {TRL's key: whole
    number}; the rest of argv); ValueError with the reason for a bad value.

    >>> typed_trl_batch(["--per-device-train-batch-size", "8", "--gradient-accumulation-steps=4", "--lr", "1e-6"])
    ({'per_device_train_batch_size': 8, 'gradient_accumulation_steps': 4}, ['--lr', '1e-6'])
    """
    found, rest = typed_trl(argv, TRL_BATCH_KEYS)
    for key, value in found.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            raise ValueError(f"{flag} needs a value (TRL's {key})")
        try:
            found[key] = int(value)
        except ValueError:
            raise ValueError(f"{flag} takes a whole number (got {value!r})") from None
    return found, rest


def trl_step_flags(file_steps: dict, typed_steps: dict, file_flags: list[str], typed: list[str], prog: str,
                   note) -> list[str]:
    """The command line: a --config file's flags, then the flags TRL's step counts make (TRL_STEP_KEYS: the file's
    `file_steps`, and `typed_steps`, each typed key winning over the file's; `trl_steps`, counted in the optimizer
    steps of an iteration of this run, or of the checkpoint's run it resumes), then the `typed` flags. An option of
    ours for the same thing wins where it is typed, or where it is in the file and the TRL key is too (a typed TRL
    key wins over the file's option), said in a `note` line. ValueError where --max-steps and --iterations, or
    --num-train-epochs, are typed together (TRL has no --iterations; a file's num_train_epochs gave way in
    `file_arguments`)."""
    parser = build_parser(prog, defaults=False)
    typed_given, file_given = set(values_of(parser.parse_args(typed))), set(values_of(parser.parse_args(file_flags)))
    steps = {**file_steps, **typed_steps}
    if typed_steps.get("max_steps", -1) != -1 and typed_given & {"iterations", "num_train_epochs"}:
        ours = "--iterations" if "iterations" in typed_given else "--num-train-epochs"
        raise ValueError(f"--max-steps {typed_steps['max_steps']} and {ours} both set the run's length: give one")
    for key, ours in TRL_STEPS.items():
        named = [k for k in (key, STEP_STRATEGIES.get(key)) if k in steps]
        beaten = ours in typed_given or ours in file_given and not any(k in typed_steps for k in named)
        if named and beaten:
            note(f"ignored TRL's {', '.join(named)}: --{ours.replace('_', '-')} is given")
            steps = {k: v for k, v in steps.items() if k not in named}
    run = build_parser(prog).parse_args(file_flags + typed)
    updates, passes = run.updates_per_iteration, run.num_iterations
    if run.resume is not None:  # a resumed run's iterations are its checkpoint's (infra/checkpoint.py), unless typed
        from infra.outputs import checkpoints
        found = (checkpoints(run.out)[-1:] if run.resume == "auto" and run.out else [Path(run.resume)]
                 if run.resume != "auto" else [])
        try:
            saved = json.loads((found[0] / "state.json").read_text())["config"] if found else {}
        except (OSError, ValueError, KeyError, TypeError):  # not a checkpoint: infra/checkpoint.py says so, later
            saved = {}
        saved = {key: value for key, value in (saved if isinstance(saved, dict) else {}).items()
                 if key in ("updates_per_iteration", "num_iterations") and isinstance(value, int) and value > 0}
        updates = updates if "updates_per_iteration" in typed_given else saved.get("updates_per_iteration", updates)
        passes = passes if "num_iterations" in typed_given else saved.get("num_iterations", passes)
    try:
        options = trl_steps(steps, updates, passes, note)
    except ValueError as error:  # typed, TRL's keys are named as the flags typed (--max-steps 3, not max_steps 3)
        if file_steps:
            raise
        raise ValueError(re.sub(r"\b(" + "|".join((*TRL_STEP_KEYS, "logging_steps")) + r")\b",
                                lambda key: "--" + key.group(1).replace("_", "-"), str(error))) from None
    return file_flags + [f"--{name.replace('_', '-')}" + ("" if value is True else f"={value}")
                         for name, value in options.items()] + typed


def typed_trl_flags(argv: list[str], note) -> tuple[dict, dict, list[str]]:
    """(TRL's flags typed for what has no use here or at what this trainer does, TRL_UNUSED and TRL_FIXED: {key:
    value}; TRL's step counts, TRL_STEP_KEYS, as numbers, with logging_steps for eval_steps; the rest of argv).
    A typed --max-steps drops a typed --num-train-epochs, and TRL's switches become our options (TRL_SWITCHES: --bf16
    false is --dtype float32, --use-cpu --device cpu, unless that option is typed), as TRL reads them; those and the
    flags ignored are said in `note` lines. ValueError for a bad count, a TRL_FIXED key at another value
    (`unknown_option`'s line) or a TRL switch (--bf16, --torch-compile ...) whose word is not a boolean."""
    unused, argv = typed_trl(argv, TRL_UNUSED)  # typed as for TRL (--bf16, --logging-steps 10): ignored, as a file's
    typed_steps, argv = typed_trl(argv, TRL_STEP_KEYS)  # --max-steps, --save-steps ...: read as iterations later
    # the counts as numbers: --max-steps=-1 is TRL's "unset", as -1 in a file
    typed_steps = {key: number_of_steps(key, value) if key in TRL_STEPS else value
                   for key, value in typed_steps.items()}
    if "logging_steps" in unused and "eval_steps" not in typed_steps:  # TRL's eval_steps null: every logging_steps
        typed_steps["logging_steps"] = unused["logging_steps"]
    fixed, argv = typed_trl(argv, TRL_FIXED)  # --use-vllm false: ignored at what this trainer does, as in a file
    for key, value in fixed.items():
        if isinstance(value, str) and all(isinstance(v, bool) for v in TRL_FIXED[key][0]):  # a switch: true/false
            value = BOOL_WORDS.get(value.lower(), value)
        if not is_fixed_value(key, value):
            raise ValueError(unknown_option("--" + key.replace("_", "-")))
        unused[key] = value
    if typed_steps.get("max_steps", -1) != -1:  # TRL's max_steps wins over its num_train_epochs, typed too
        epochs, argv = typed_trl(argv, ("num_train_epochs",))
        if epochs:
            note(f"ignored --num-train-epochs {epochs['num_train_epochs']}: --max-steps sets the run's length, as in "
                 "TRL")
    for key in TRL_SWITCHES:  # --bf16, --torch-compile, --use-cpu: a switch's word, or none
        if isinstance(unused.get(key), str) and unused[key].lower() not in BOOL_WORDS:
            raise ValueError(f"--{key.replace('_', '-')} takes true or false, or no value (got {unused[key]!r})")
    typed = {token.split("=")[0][2:].replace("-", "_") for token in argv if token.startswith("--")}
    for key, (when, option, value, _) in TRL_SWITCHES.items():  # --bf16 false, --use-cpu: our options
        switch = unused.get(key)
        if (BOOL_WORDS.get(switch.lower(), switch) if isinstance(switch, str) else switch) is when \
                and switch_taken(key, typed):
            argv = [f"--{option.replace('_', '-')}={value}", *argv]
            note(switch_line(key, typed=True))
            del unused[key]
    if unused:
        reasons: dict[str, list[str]] = {}
        for key in unused:
            why = TRL_UNUSED[key] if key in TRL_UNUSED else f"here {TRL_FIXED[key][1]}"
            reasons.setdefault(why, []).append(f"--{key.replace('_', '-')}" + (f" {unused[key]}" if key in fixed
                                                                               else ""))
        note("ignored TRL's " + "; ".join(f"{', '.join(flags)}: {why}" for why, flags in reasons.items()))
    return unused, typed_steps, argv


def with_config_file(argv: list[str] | None = None, prog: str = "trainer.py", say: bool = False) -> list[str]:
    """argv (default: sys.argv[1:]) with its --config file's options put before it, and TRL's batch flags, typed
    (typed_trl_batch) or the file's, as the --batch-size and --updates-per-iteration they make (trl_batch_options;
    a key typed wins over the file's); on a bad file or value one line on stderr and exit code 2, as for a bad flag.
    `say`: print the file's ignored keys and the translations (once per run: on rank 0)."""
    argv = normalized(list(sys.argv[1:] if argv is None else argv))

    def typed_note(line: str) -> None:
        if say and os.environ.get("RANK", "0") == "0":
            print(f"periodic-rl: {line}", flush=True)
    try:
        unused, typed_steps, argv = typed_trl_flags(argv, typed_note)
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        raise SystemExit(2) from None
    try:
        typed, argv = typed_trl_batch(argv)
        path = config_file(argv)
        if path is None and typed:
            given = set(values_of(build_parser(prog, defaults=False).parse_args(argv)))
            options = trl_batch_options(typed, {}, given, typed_note, Config.group_size)
            argv = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()] + argv
        if path is None and typed_steps:
            argv = trl_step_flags({}, typed_steps, [], argv, prog, typed_note)
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        raise SystemExit(2) from None
    if path is None:
        return argv
    argv = normalized(argv)
    given = set(values_of(build_parser(prog, defaults=False).parse_args(argv)))  # a list option typed on the command
    # line replaces the file's
    skip = set(given) | (set(TRL_SWITCHES) & set(unused))  # the file's value of an option typed anew is
    # replaced (TRL's --bf16 too: the file's bf16 false does not make it float32)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun each rank places its own devices (distributed.py)
        skip |= {"train_device", "rollout_device"}

    lines: list[str] = []  # said once the file is read: a refused file is not described
    try:
        file_steps: dict = {}
        flags = file_arguments(path, skip=skip, note=lines.append, typed_batch=typed, typed_steps=typed_steps,
                               steps=file_steps, rederived={derived for option in given
                                                            for derived in DERIVED_FROM.get(option, ())})
        check = build_parser(prog, defaults=False)  # a value of the wrong type, named with the file
        check.exit_on_error = False                    # (argparse's line alone left the file out)
        try:
            check.parse_known_args(flags)
        except argparse.ArgumentError as error:
            raise ValueError(str(error)) from None
        argv = (trl_step_flags(file_steps, typed_steps, flags, argv, prog, lines.append)
                if file_steps or typed_steps else flags + argv)
        source = config_source(path)
        for line in lines:
            typed_note(f"{source}: {line}")
        return argv
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: {config_source(path)} {error}\n")
        raise SystemExit(2) from None


def named_as_typed(text: str, argv: list[str], iterations: int) -> str:
    """A message about our options (`text`) with each named as `argv` typed it: a TRL alias by its own flag
    (--learning-rate for --lr), --iterations typed as TRL's --max-steps in optimizer steps (`iterations`: the count the
    typed --max-steps made; a --config file's keys are named by the file's lines).

    >>> named_as_typed("--iterations 3 differs from the checkpoint's 4 (drop --iterations)", ["--max-steps=6"], 3)[50:]
    "differs from the checkpoint's 8 (4 iterations) (drop --max-steps)"
    >>> named_as_typed("--lr 0.1 differs", ["--learning_rate", "0.1"], 60)
    '--learning-rate 0.1 differs'
    """
    typed = {token.partition("=")[0][2:].replace("-", "_") for token in normalized(argv) if token.startswith("--")}
    for key in typed & set(TRL_ALIASES):
        text = re.sub(rf"--{TRL_ALIASES[key].replace('_', '-')}\b(?!-)", f"--{key.replace('_', '-')}", text)
    steps, _ = typed_trl(normalized(argv), ("max_steps",))
    if "max_steps" in steps and "iterations" not in typed:
        per = max(1, number_of_steps("max_steps", steps["max_steps"]) // max(1, iterations))  # optimizer steps each
        if per > 1:  # the counts in optimizer steps, then in iterations
            text = re.sub(r"--iterations (\d+) differs from the checkpoint's (\d+)",
                          lambda m: f"--max-steps {int(m[1]) * per} ({m[1]} iterations of {per} optimizer steps) "
                                    f"differs from the checkpoint's {int(m[2]) * per} ({m[2]} iterations)", text)
        text = re.sub(r"--iterations( \d+)?\b", lambda m: "--max-steps" + (f" {int(m[1]) * per}" if m[1] else ""),
                      text)
    return text
