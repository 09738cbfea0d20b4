"""How `python trainer.py` ends: exit code 0; 1 after one `error:` line for a problem a user can fix (a bad
option, a missing model, a closed standard output); 128 + signal after a stop signal (infra/stopping.py), with one
`interrupted by SIG...` line saying what was kept (the checkpoint --resume auto continues from)."""
from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

from config import Config
from infra import outputs
from infra.console import STDOUT_CLOSED
from infra.errors import UserError
from infra.stopping import Interrupted, stopped_by_signals
from launch.run_output import PROCESS_STARTED, earlier_rows


class Ending:
    """The exit code of a run (`code`), and what its last line names: the options and this process's ranks, once
    read (`cfg`, `ranks`); torchrun's agent (`launcher`, the parent, read before anything loads)."""

    def __init__(self):
        self.code, self.cfg, self.ranks, self.launcher = 0, None, None, os.getppid()

    @contextmanager
    def handled(self):
        """The block with stop signals caught: a UserError or a stop ends it with its one line and sets `code`. A stop
        counts for this run only: none is left pending for what the process does next (another run, from Python)."""
        Interrupted.received = Interrupted.held = None
        try:
            failed_save = None  # an output a stop could not write (its checkpoint)
            with stopped_by_signals():
                try:
                    yield self
                    return
                except UserError as error:
                    if Interrupted.received is None:
                        sys.stderr.write(f"error: {rank_prefix(self.ranks)}{error}\n")
                        self.code = 1
                        return
                    failed_save = failed_output(error)  # not the signal's doing
                except ValueError:  # "I/O operation on closed file": something in the run closed sys.stdout
                    if Interrupted.received is None:
                        if not sys.stdout.closed:
                            raise
                        sys.stderr.write(f"error: {rank_prefix(self.ranks)}{STDOUT_CLOSED}\n")
                        self.code = 1
                        return
                except BrokenPipeError:  # stdout's reader exited (`| head`): stop, as Unix tools do, and say so
                    if Interrupted.received is None:
                        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush can't fail
                        with suppress(BrokenPipeError):  # stderr may be the same closed pipe (2>&1)
                            sys.stderr.write("error: standard output was closed (its reader exited, e.g. `| head`): "
                                             "the run stopped and the inference process with it; to keep the log, "
                                             "use `> log.txt` or `| tee log.txt`\n")
                        self.code = 1
                        return
                except BaseException as error:  # a stop signal, or the error of something it cut short (an import)
                    if Interrupted.received is None and not isinstance(error, KeyboardInterrupt):
                        raise
                    failed_save = failed_output(error)  # a full disk the stop cut short, or came to as it went up
            self.code = stopped(self.cfg, self.ranks, failed_save)
        finally:  # handled here: nothing pending for a later run in this process, or a later check
            Interrupted.received = Interrupted.held = None


def stopped(cfg: Config | None, ranks, failed_save: Exception | None) -> int:
    """A stop signal's line on stderr (what was kept, or why torchrun stopped this rank); its exit code."""
    signum = Interrupted.received or signal.SIGINT
    with suppress(OSError):  # SIGHUP: the terminal may be gone
        by_torchrun = rank_prefix(ranks) and signum == signal.SIGTERM  # how torchrun stops the others when a rank fails
        liveness = sys.modules.get("infra.liveness")  # imported with infra/distributed.py once the run has started
        gone = liveness.gone_neighbours() if by_torchrun and liveness else []
        if gone:  # a rank on this host ended first: that is why torchrun stopped this one
            sys.stderr.write(f"error: {rank_prefix(ranks)}{liveness.ended_first(gone)}, so torchrun stopped this rank "
                             "(torchrun's report names its exit code or signal); nothing is left running\n")
        else:
            sys.stderr.write(f"{rank_prefix(ranks)}interrupted by {signal.Signals(signum).name}: the run was stopped, "
                             "nothing is left running" + (" (torchrun stops every rank once one fails: its report "
                                                          "names the rank and why)" if by_torchrun else "")
                             + kept_on_stop(cfg, ranks, failed_save) + "\n")
    return 128 + signum


def rank_prefix(ranks=None) -> str:
    """'trainer rank r of M: ' (or 'inference rank j of K (rank r): ', once `ranks` knows the roles) under torchrun
    (every rank reports for itself), else ''."""
    if ranks is not None and ranks.world > 1:
        return ranks.name() + ": "
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    return f"trainer rank {rank} of {size}: " if rank is not None and size != "1" else ""


def raised_while(error: BaseException | None):
    """`error`, then the exception it was raised while handling, and so on (each one's __context__)."""
    while error is not None:
        yield error
        error = error.__context__


def failed_output(error: BaseException) -> outputs.OutputError | None:
    """The output a stopping run could not write: `error` itself, or one it was raised while handling (a stop signal
    raised while a full disk's error went up, or a second one while the inference process was awaited)."""
    return next((e for e in raised_while(error) if isinstance(e, outputs.OutputError)), None)


def kept_on_stop(cfg: Config | None, ranks, failed_save: Exception | None) -> str:
    """What a stop kept, for the end of its line. With --save-every or --save-on-stop: the checkpoint --resume auto
    continues from against the iterations done (metrics.jsonl's rows), or why the stop checkpoint is missing;
    without them, that the iterations done were not saved and which option keeps them. '' on the ranks that do
    not write --out, and before the options are read."""
    checkpoint = sys.modules.get("infra.checkpoint")  # imported once the options are read
    if cfg is None or cfg.out is None or checkpoint is None or ranks and not ranks.is_main:
        return ""
    iterations = cfg.iterations
    if cfg.num_train_epochs is not None:  # counted once the data was read: config.json records the count
        with suppress(OSError, ValueError, KeyError, TypeError):
            iterations = int(json.loads((Path(cfg.out) / "config.json").read_text())["iterations"])
    done = len(earlier_rows(Path(cfg.out) / "metrics.jsonl", iterations))
    if not (cfg.save_every or cfg.save_on_stop):
        policy = Path(cfg.out) / "policy"  # written atomically once training ended: by this process, if lately
        if policy.is_dir() and policy.stat().st_mtime >= PROCESS_STARTED:
            return f"; training had ended: the policy is in {policy}"
        return (f"; the {done} iteration{'s' * (done > 1)} done {'were' if done > 1 else 'was'} not saved "
                "(--save-on-stop keeps them when a run is stopped, --save-every N as it goes)") if done else ""
    found = checkpoint.checkpoints(cfg.out)
    newest = found[-1] if found else None
    k = checkpoint.read_state(newest)["iterations_done"] if newest else 0
    if failed_save is not None:
        by_stop = any(isinstance(e, KeyboardInterrupt) for e in raised_while(failed_save.__context__))
        lost = (f"the stop checkpoint could not be written ({failed_save})" if by_stop  # (the stop's own save)
                else f"as the stop came, {failed_save}")
    elif k < done:
        lost = f"no checkpoint holds iterations {k} to {done - 1}"  # a stop half-way through an iteration's steps
    elif newest is None:
        return "; no iteration was done, so no checkpoint was written"
    else:
        return f"; {newest} holds the {k} iterations done: --resume auto --out {cfg.out} continues from there"
    return f"; {lost}: " + (f"--resume auto --out {cfg.out} continues from {newest} ({k} of the {done} iterations "
                            "done)" if newest
                            else "there is no checkpoint to resume from")

