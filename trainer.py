"""Entry point: `python trainer.py [--model qwen2.5-0.5b] [--mode async|sync] ...` (see --help).

Read top to bottom, it is the run: `main` reads the options, `run` opens --out, and `started` is the loop's set-up
in the method's order: the task and rewards, the inference side (spawned first, so its load overlaps the trainer's),
the policy, the tri-model and AdamW (launch/setup.py), the sizes and where sampling runs, then
`periodic_rl.train`, one metrics row per iteration. Everything else is one call into a package below:
the command line, TRL's names and files, --resume and torchrun's roles (launch/start.py); what --out holds, the
trackers, the saved policy (launch/run_output.py); how a run ends, with one `error:` line or one `interrupted by
SIG...` line and a non-zero exit, no traceback (launch/exits.py); `train`, the same run from Python
(launch/python_api.py).

Launched by torchrun, each process is one trainer rank (infra/distributed.py, docs/distributed.md): rank 0
logs and writes --out; the others print nothing on stdout and never touch --out.
"""
from __future__ import annotations

import sys
from contextlib import closing, contextmanager
from pathlib import Path

from config import Config
from infra.processes import children_end_with_their_parent
from infra.stopping import Interrupted, exit_without_lingering
from launch import python_api, run_output, start
from launch.exits import Ending
from launch.start import load_policy, prepare, quiet_unless_main, say_start, serve

# A reward's process pool ends with the run. A spawned process imports its parent's main module as __mp_main__:
# trainer.py itself, or the script that called `train` (which imports this module).
children_end_with_their_parent(spawned="__mp_main__" in sys.modules)


def main(argv: list[str] | None = None) -> int:
    """`python trainer.py [options]`; the exit code: 0, 1 after one `error:` line, 128 + signal after a stop."""
    end = Ending()
    with end.handled():  # a problem a user can fix, or a stop signal: one line on stderr, end.code
        argv = sys.argv[1:] if argv is None else argv
        cfg, resume_from, ranks = start.options(argv, end)  # TRL's names and files, --resume, torchrun's roles
        if cfg is None:  # the same command resubmitted once its run is complete: nothing to do (said so)
            return 0
        from infra import distributed
        with quiet_unless_main(ranks), distributed.process_group(cfg, ranks):
            if ranks.is_inference:  # an inference rank (--inference-ranks) samples for the trainer ranks
                serve(cfg, ranks)
            else:
                cfg, fresh = run_output.own_folder(cfg, ranks)  # no --out: a folder of its own, runs/latest
                run(cfg, resume_from, ["trainer.py", *argv], ranks, link_latest=fresh)
        Interrupted.check()
    return end.code


def run(cfg: Config, resume_from: Path | None = None, command: list[str] | None = None, ranks=None,
        link_latest: bool = False) -> dict:
    """Train as configured (on from a checkpoint); returns the final row (with the start and end held-out rewards).
    --out is claimed and the options recorded before a model loads (launch/run_output.py; on rank 0 only)."""
    with run_output.opened(cfg, resume_from, command, ranks, link_latest) as output, \
            started(cfg, resume_from, ranks, output) as (rows, policy, tokenizer):
        return output.log_and_save(rows, policy, tokenizer)


@contextmanager
def started(cfg: Config, resume_from: Path | None = None, ranks=None, output: run_output.RunOutput | None = None):
    """The run as configured, ready to iterate: (rows, policy, tokenizer), rows being `periodic_rl.train`'s, with a
    checkpoint every --save-every and the trace at the end (setup.checkpointed). `resume_from`: a checkpoint to go
    on from; `ranks`: this trainer rank (infra/distributed.py); `output`: told the options once the data is read and
    once sized, and the completions (--log-completions).

    The `with` block owns the inference process (async mode) from spawn to stop, however the block is left.
    """
    import periodic_rl  # torch loads here, once the stop signals are caught and OpenMP is set (start.options)
    from infra.distributed import Ranks
    from launch import setup
    ranks, output = ranks or Ranks(), output or run_output.RunOutput(cfg)
    cfg, task, rewards, load_kwargs = prepare(cfg)  # devices checked; the data and the reward functions read
    output.prepared(cfg)
    Interrupted.check()  # a Ctrl-C that a C extension swallowed while torch was imported stops the run here
    with setup.inference_side(cfg, load_kwargs, task.train, task.held_out, load=not cfg.is_tiny,
                              ranks=ranks) as rollouts:  # spawned before the trainer loads its own copy
        policy, tokenizer = load_policy(cfg, load_kwargs, rollouts)  # θ_0, float32 masters on --train-device
        Interrupted.check()  # and one swallowed while transformers' models were imported
        say_start(cfg, policy, tokenizer, task, ranks)  # prompt lengths checked; the first line
        training = setup.training_side(cfg, policy, tokenizer, resume_from)  # the tri-model, AdamW, θ_k if resumed
        cfg, rollouts, learner = setup.sampling_side(cfg, training, policy, tokenizer, task.train, task.held_out,
                                                     rewards, load_kwargs, rollouts, ranks)  # sizes, sampler, learner
        output.sized(cfg)
        rows = periodic_rl.train(cfg, policy, rollouts, learner, learner.timeline, first=training.first,
                                 held_out=bool(task.held_out),
                                 train_threads_after_sampling=setup.train_threads_after_sampling(cfg, ranks),
                                 sample_then_train=setup.sample_then_train(cfg, ranks), ranks=ranks)
        with closing(setup.checkpointed(rows, cfg, training, learner, tokenizer, len(task.train), ranks,
                                        output.completions)) as rows:
            yield rows, policy, tokenizer


def train(model: str | None = None, reward_funcs=None, train_dataset=None, eval_dataset=None, args=None, **options):
    """The run `python trainer.py` makes, from Python, as TRL's `GRPOTrainer(model, reward_funcs, args,
    train_dataset).train()`; `options`: any option of --help with _ for - (launch/python_api.train says more).
    Returns the run's --out folder (python_args.TrainedRun), None on a rank that writes none."""
    return python_api.train(main, model, reward_funcs, train_dataset, eval_dataset, args, **options)


if __name__ == "__main__":
    exit_without_lingering(main())
