"""What a run says on the terminal: its first line (`start_line`), a line per iteration (`format_row`: the columns
--help lists), the warnings (`unscored_line`), a progress line now and then off a terminal (`progress_line`; on a
terminal tqdm's bar), all written by `say`, above the bar. launch/run_output.log_and_save decides when each is said.
"""
from __future__ import annotations

import sys

from config import Config, engine_compiles, train_compiles
from infra import outputs, sharing
from infra.tasks import prompt_text


def format_row(row: dict) -> str:
    """One log line per iteration (its columns: `python trainer.py --help`, infra/trl_names.LOG_COLUMNS); the final
    row's when the run evaluated θ_final, else ''."""
    def num(key, spec):
        return "-" if row.get(key) is None else format(row[key], spec)
    rate = row.get("tokens_per_s")  # three digits below 100 (a 0.5B-wide model on CPU: 2.37 tok/s, not 2)
    if row.get("final"):  # nothing to say without an evaluation
        evaluated = row.get("eval_reward") is not None
        return f"final  held-out reward {num('eval_reward', '.3f')} (θ_{row['policy_version']})" if evaluated else ""
    return (f"iter {row['iteration']:4d}  reward {num('reward_mean', '.3f')}±{num('reward_std', '.2f')}  "
            f"eval {num('eval_reward', '.3f')}  kl {num('kl', '.4f')}  clip {num('clip_fraction', '.3f')}  "
            f"len {num('response_length', '.1f')}  gen {num('generate_s', '.2f')}s  "
            + (f"(+{row['eval_s']:.2f}s eval)  " if row.get("eval_s") else "") + f"train {num('train_s', '.2f')}s  "
            f"idle gen/train {num('idle_inference_s', '.2f')}/{num('idle_training_s', '.2f')}s  "
            f"overlap {num('overlap', '.0%')}  {num('tokens_per_s', '.0f' if (rate or 0) >= 100 else '.3g')} tok/s")


STDOUT_CLOSED = ("standard output was closed inside the run (sys.stdout.close() in a reward function, or in a library "
                 "it calls): the log cannot be written; leave sys.stdout open")


def say(line: str) -> None:
    """One line of the log on stdout (through tqdm, above its progress bar)."""
    from tqdm import tqdm
    try:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    except ValueError:  # "I/O operation on closed file"
        if not sys.stdout.closed:
            raise
        raise outputs.OutputError(STDOUT_CLOSED) from None


PROGRESS_EVERY_S = 30.0  # off a terminal, a progress line at the first iteration to end after this many seconds


def progress_line(done: int, total: int, elapsed: float, pace: float) -> str:
    """What the progress bar shows, as one line: iterations done of `total`, the seconds so far, and the time left
    at `pace` seconds per iteration.

    >>> progress_line(12, 60, 41.0, 3.4)
    'periodic-rl: progress 12/60 iterations, 00:41 elapsed, ~02:43 left'
    """
    from tqdm import tqdm
    return (f"periodic-rl: progress {done}/{total} iterations, {tqdm.format_interval(elapsed)} elapsed, "
            f"~{tqdm.format_interval((total - done) * pace)} left")


def text_prompts_note(tokenizer, examples, raw: bool) -> tuple[str, ...]:
    """What the first line says of text prompts where the model has a chat template (--text-prompts): used as they
    are, or rendered in it; () when there are none, or no template to choose (none, or one that renders the user's
    text as it is: the tiny model's)."""
    text = next((e.prompt for e in examples if isinstance(e.prompt, str)), None)
    if not getattr(tokenizer, "chat_template", None) or text is None or prompt_text(tokenizer, text) == text:
        return ()
    return ("text prompts as they are, as TRL takes its 'prompt' column; --text-prompts chat renders them in the "
            "chat template",) if raw else ("text prompts in the model's chat template, as the user's message; "
                                           "--text-prompts raw takes them as they are",)


def start_line(cfg: Config, train: int, held_out: int, notes: tuple[str, ...] = (), trainers: int = 1,
               inference_ranks: int = 0, memory: tuple[float, float] = (0.0, 0.0)) -> str:
    """The run's first line: mode and how the hardware is shared (infra/sharing.py), model, the processes when there
    are several (torchrun's `trainers` ranks, each with --inference-workers samplers, or `inference_ranks` samplers),
    the prompts (with `notes`, data.Task's: the column they come from when two could be, the split held out, that it
    has fewer rows than --eval-size asked, and that it is never evaluated), the schedule, the `memory` to expect (the
    trainer's and the inference side's bytes: launch/sizing.memory_estimate; said from 0.1 GB on), --out, and when the
    engine's decode step is compiled (--engine auto on CUDA, or compile), and when the training side's layers are
    (--compile-train on), the one-time cost of compiling them.

    >>> start_line(Config(mode="async", model="m", out="o"), 90, 10, trainers=2, inference_ranks=6)[:95]
    'periodic-rl: async (sampling on inference ranks) | model m | 2 trainer ranks, 6 inference ranks'
    """
    if held_out and not cfg.eval_every:  # --eval-size given with --eval-every 0: kept out of training all the same
        notes = (*notes, "held out, not evaluated: --eval-every 0")
    if held_out and cfg.eval_every and cfg.eval_samples:  # what evaluating costs, against training's sampling
        notes = (*notes, eval_cost(cfg, held_out))
    said = f" ({'; '.join(notes)})" if notes else ""
    samplers = (f"{inference_ranks} inference rank{'s' * (inference_ranks > 1)}" if inference_ranks else
                f"{cfg.inference_workers} inference worker{'s' * (cfg.inference_workers > 1)}"
                + (" each" if trainers > 1 else "") if cfg.mode == "async" else "")
    processes = ", ".join(part for part in (f"{trainers} trainer ranks" if trainers > 1 else "",
                                            samplers if trainers > 1 or inference_ranks
                                            or cfg.inference_workers > 1 else "") if part)
    sampler = cfg.rollout_device or cfg.device
    cost = "about a minute on CPU" if sampler.startswith("cpu") else "~10 s on a GPU"
    compiled = (f" | sampling compiled: each sampler's first generate call compiles one layer and the draw, once "
                f"({cost}; --engine eager skips it)" if cfg.engine != "hf" and engine_compiles(cfg.engine, sampler)
                else "")
    if train_compiles(cfg.compile_train):
        compiled += (" | training compiled: the first micro-batches compile one decoder layer, forward and backward, "
                     "once (tens of seconds to minutes; --compile-train off skips it)")
    return (f"periodic-rl: {cfg.mode} ({sharing.describe(cfg, inference_ranks)}) | model {cfg.model} | "
            f"{processes + ' | ' if processes else ''}{train} train / "
            f"{held_out} held-out prompts{said} | {cfg.iterations} iteration{'s' * (cfg.iterations != 1)} x "
            f"{cfg.prompts_per_iteration} prompts "
            f"x {cfg.group_size} | "
            + (f"memory ~{memory[0] / 1e9:.1f} GB trainer, ~{memory[1] / 1e9:.1f} GB inference (an estimate from the "
               "parameters, activations aside) | " if sum(memory) >= 1e8 else "")
            + f"out {cfg.out}{compiled}")


def eval_cost(cfg: Config, held_out: int) -> str:
    """The held-out evaluation's responses (θ_0, every --eval-every iterations, θ_final) as a share of those training
    samples.

    >>> eval_cost(Config(iterations=60, batch_size=128, eval_every=10, eval_samples=1), 64)
    'evaluated every 10 iterations and at the end, 1 response per prompt: 448 responses, 6% of the 7680 trained on'
    """
    evaluated = held_out * cfg.eval_samples * (-(-cfg.iterations // cfg.eval_every) + 1)
    trained = cfg.batch_size * cfg.iterations
    return (f"evaluated every {cfg.eval_every} iterations and at the end, {cfg.eval_samples} "
            f"response{'s' * (cfg.eval_samples > 1)} per prompt: {evaluated} responses, {evaluated / trained:.0%} of "
            f"the {trained} trained on")


def unscored_line(iteration: int, share: float) -> str:
    """The warning for responses that no reward scored (every --reward returned None for them), said once a run, as
    TRL warns when all its reward functions return None.

    >>> unscored_line(3, 0.25)[:81]
    'periodic-rl: warning: iteration 3: 25% of the responses were scored by no reward '
    """
    percent = f"{share:.0%}" if share >= 0.01 else "under 1%"
    return (f"periodic-rl: warning: iteration {iteration}: {percent} of the responses were scored by no reward "
            f"(every --reward returned None, or NaN, for them): they count in no reward mean and get advantage 0"
            f"{', so this step learns nothing from the rewards' if share == 1 else ''}. Said once; each iteration's "
            f"share is frac_reward_unscored in metrics.jsonl.")


def eval_summary(first: float | None, last: float | None, evaluating: bool) -> str:
    """The done line's account of the held-out reward: at the run's first evaluation and at its end (None where no
    evaluation ran or none of its responses was scored); `evaluating`: the run evaluates (--eval-every, --eval-size).

    >>> eval_summary(0.391, 0.88, True), eval_summary(None, None, False)
    ('held-out reward 0.391 -> 0.880', 'no held-out evaluation ran')
    >>> eval_summary(0.0, None, False)  # resumed with --eval-every 0
    'held-out reward 0.000 at the start; no final evaluation (--eval-every 0)'
    """
    if first is None and last is None:
        return ("held-out rewards: none scored (every reward returned None for every held-out response)" if evaluating
                else "no held-out evaluation ran")
    if last is None:
        end = "none scored at the end" if evaluating else "no final evaluation (--eval-every 0)"
        return f"held-out reward {first:.3f} at the start; {end}"
    return f"held-out reward {last:.3f} at the end" if first is None else f"held-out reward {first:.3f} -> {last:.3f}"
