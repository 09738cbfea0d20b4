"""`trainer.train`: the run `python trainer.py` makes, called from Python as TRL's `GRPOTrainer(...).train()` is
(its arguments turned into the command line by infra/python_args.py)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from launch.run_output import LAST_RUN


def train(main, model: str | None = None, reward_funcs=None, train_dataset=None, eval_dataset=None, args=None,
          **options):
    """Run the trainer (`main`: trainer.main) from Python, as TRL's `GRPOTrainer(model, reward_funcs, args,
    train_dataset).train()` runs: the run `python trainer.py` makes with these options (infra/python_args.train_argv);
    returns its --out folder, a Path with TRL's `log_history`, `policy_path` and `save_model(dir)`
    (python_args.TrainedRun; under torchrun, on rank 0; a rank that writes no run returns None).
    `model`: a hub id, a folder or an alias (not a model object: each process loads its own copy);
    `reward_funcs`: a function (defined at the top level of a module or of the script) or a --reward spec, or a list
    of them; `peft_config`: peft's LoraConfig, as --use-peft and its --lora-* options; `train_dataset`: a
    datasets.Dataset or DatasetDict, or a --data value; `args`: TRL's GRPOConfig (or a mapping), read as a --config
    file is; `options`: any option of `python trainer.py --help` with _ for -, ours or TRL's (learning_rate=1e-6,
    num_generations=8, max_steps=100, per_device_train_batch_size=8, ...). A script that calls it needs
    `if __name__ == "__main__":` around the call, as any script that starts processes with multiprocessing does
    (its reward functions above that block). RuntimeError with the exit code where the run
    fails (its `error:` line is on stderr, as on the command line); KeyboardInterrupt where Ctrl-C stopped it,
    SystemExit(128 + signal) where SIGTERM or SIGHUP did.

    Example: train("qwen2.5-0.5b", reward_funcs=[accuracy], train_dataset=load_dataset("openai/gsm8k", "main",
             split="train"), learning_rate=1e-6, max_steps=100)
    """
    try:
        from infra.python_args import TrainedRun, train_argv
        argv = train_argv(model, reward_funcs, train_dataset, eval_dataset, args, **options)
    except ValueError as error:  # a reward or dataset no other process can find: the caller's mistake, said so
        raise ValueError(f"train: {error}") from None
    LAST_RUN.clear()
    script = sys.modules.get("__main__")
    unreadable = getattr(script, "__file__", None) and not Path(script.__file__).is_file()  # `python < script.py`
    if unreadable:  # multiprocessing's spawn would run the script's path again: like `python -c`, it imports nothing
        saved = script.__file__
        del script.__file__
    try:
        code = main(argv)
    except SystemExit as stop:  # a bad option: argparse's one line is on stderr
        code = stop.code
    finally:
        if unreadable:
            script.__file__ = saved
    if code == 128 + signal.SIGINT:  # Ctrl-C: the run stopped (its line is above), as a script expects of Ctrl-C
        raise KeyboardInterrupt
    if code and code > 128:  # SIGTERM, SIGHUP: the process was asked to stop
        raise SystemExit(code)
    if code:
        raise RuntimeError(f"the run ended with exit code {code} (its error line is above; the options it names are "
                           "train's keywords, with _ for -: --resume auto is resume='auto'): python trainer.py "
                           + " ".join(argv))
    return TrainedRun(LAST_RUN[0]) if LAST_RUN and LAST_RUN[0] else None  # another rank than 0 (torchrun) writes none
