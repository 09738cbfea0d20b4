"""How the two sides share the hardware, and `--mode auto`'s choice from it: async where they can compute at once,
sync where they would only take turns.

Periodic asynchrony saves time only where sampling and training run at the same moment. Where that can happen:

    separate devices             the inference side on its own (cuda:0 sampling, cuda:1 training, inference ranks)
    one CUDA device, with MPS    NVIDIA's Multi-Process Service runs two processes' kernels side by side; the
                                 inference process is held to CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the SMs
                                 (`mps_percentage`: the size split, as the threads split CPU cores)
    CPU cores                    two core groups, one per side, when the size probe predicts the split is faster
                                 than sampling then training on every core (launch/sizing.py); else the sides
                                 sample then train in one process (launch/setup.async_runs_as_sync, sync's schedule)

and where it cannot: one CUDA device without MPS (the driver time-slices two processes' contexts: their kernels
never overlap, so async only adds the hand-over), one NPU (no such service). There `auto` picks sync and says how
MPS would change it. Both modes are the same run bit for bit (periodic_rl.py), so the choice changes speed only.
"""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

MPS_START = "nvidia-cuda-mps-control -d"
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


def mps_running(environ=os.environ) -> bool:
    """Whether an MPS control daemon is running for this user's processes: its control pipe (a FIFO named `control`)
    in CUDA_MPS_PIPE_DIRECTORY, else in /tmp/nvidia-mps (where `nvidia-cuda-mps-control -d` puts it)."""
    pipe = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT) / "control"
    try:
        return stat.S_ISFIFO(pipe.stat().st_mode)
    except OSError:
        return False


def mps_percentage(rollout_threads: int, train_threads: int) -> int:
    """The inference process's share of the SMs under MPS, in percent: its share of the size split, as threads
    split CPU cores (at least 10%, at most 90%: neither side starves).

    >>> mps_percentage(8, 8), mps_percentage(3, 5), mps_percentage(1, 100)
    (50, 38, 10)
    """
    return max(10, min(90, round(100 * rollout_threads / (rollout_threads + train_threads))))


def kind(device: str) -> str:
    return device.split(":")[0]


def same_device(rollout_device: str, train_device: str) -> bool:
    """Whether both sides compute on one accelerator (cuda and cuda:0 are one)."""
    def index(device: str) -> str:
        return device.split(":")[1] if ":" in device else "0"
    return kind(rollout_device) == kind(train_device) and index(rollout_device) == index(train_device)


def auto_mode(rollout_device: str, train_device: str, inference_workers: int = 1, inference_ranks: int = 0,
              mps: bool | None = None) -> tuple[str, str]:
    """(mode, why) for --mode auto: async where the two sides can compute at once, sync where they would only take
    turns. `mps`: whether MPS runs (default: `mps_running`).

    >>> auto_mode("cuda:0", "cuda:1")[0], auto_mode("cuda:0", "cuda:0", mps=True)[0], auto_mode("cpu", "cpu")[0]
    ('async', 'async', 'async')
    >>> auto_mode("cuda:0", "cuda:0", mps=False)
    ('sync', 'cuda:0 shared without MPS: the driver time-slices two processes, so the sides would take turns')
    """
    if inference_ranks or inference_workers > 1:
        return "async", "inference processes of their own"
    if kind(rollout_device) == kind(train_device) == "cpu":
        return "async", ("CPU: two core groups where the size probe finds they overlap, else sample then train in one "
                         "process")
    if not same_device(rollout_device, train_device):
        return "async", f"separate devices: sampling on {rollout_device}, training on {train_device}"
    if kind(train_device) == "cuda" and (mps_running() if mps is None else mps):
        return "async", f"{train_device} shared through MPS: both sides at once"
    if kind(train_device) == "cuda":
        return "sync", f"{train_device} shared without MPS: the driver time-slices two processes, so the sides would " \
                       f"take turns"
    return "sync", f"one {kind(train_device)} device for both sides: they would take turns"


def describe(cfg, inference_ranks: int = 0) -> str:
    """How the run shares its hardware, for the first line: the resolved mode's devices, and where two processes
    would share one GPU without MPS, the command that starts it and what it gives.

    >>> from types import SimpleNamespace as Run
    >>> describe(Run(mode="sync", rollout_device="cpu", train_device="cpu", inference_ranks=0))
    'one side at a time on cpu'
    """
    rollout, train = cfg.rollout_device or "cpu", cfg.train_device or "cpu"  # (None: a Config not derived yet)
    if inference_ranks or cfg.inference_ranks:
        return "sampling on inference ranks"
    if kind(rollout) == kind(train) == "cpu":
        return ("one side at a time on cpu" if cfg.mode == "sync" else
                "CPU core groups, one per side, where the size probe finds they overlap; else sample then train")
    if not same_device(rollout, train):
        return f"sampling on {rollout}, training on {train}"
    if kind(train) == "cuda" and mps_running():
        share = mps_percentage(cfg.rollout_threads or 1, cfg.train_threads or 1)
        return (f"one side at a time on {train} (MPS is running: --mode async would run both at once)"
                if cfg.mode == "sync" else f"{train} shared through MPS, sampling held to {share}% of its SMs")
    if kind(train) != "cuda":
        return f"one side at a time on {train}" if cfg.mode == "sync" else f"{train} shared by two processes"
    how = "one side at a time on" if cfg.mode == "sync" else "two processes time-sliced on"
    return (f"{how} {train}: no NVIDIA MPS, so the sides cannot compute at once; `{MPS_START}` (as root) lets "
            "them, and --mode auto then runs async")


@contextlib.contextmanager
def mps_share(cfg, environ=os.environ):
    """For the block (the inference processes' spawn: they copy the environment then), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    = the inference side's share of the SMs, where both sides share one CUDA device through MPS and the user set
    none; the trainer's own process is left unlimited (it takes every SM while sampling idles)."""
    shared = (kind(cfg.train_device) == "cuda" and same_device(cfg.rollout_device, cfg.train_device)
              and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in environ and mps_running(environ))
    if shared:
        environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_percentage(cfg.rollout_threads or 1,
                                                                          cfg.train_threads or 1))
    try:
        yield
    finally:
        if shared:
            del environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
