"""How the two sides share the hardware (infra/sharing.py): MPS detected by its control pipe, --mode auto async
exactly where the sides can compute at once, and the first line saying how the device is shared."""
import os

import pytest

from config import Config
from infra import sharing
from infra.console import start_line
from infra.options import derive


@pytest.fixture
def mps(tmp_path, monkeypatch):
    """Sets whether an MPS daemon 'runs': its control pipe (a FIFO) in CUDA_MPS_PIPE_DIRECTORY, or no pipe."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)

    def running(on: bool) -> None:
        pipe = tmp_path / "control"
        if on and not pipe.exists():
            os.mkfifo(pipe)
        elif not on and pipe.exists():
            pipe.unlink()
    return running


def test_mps_is_detected_by_its_control_pipe(mps, tmp_path):
    """Claim: MPS counts as running only when its control FIFO exists where clients look for it."""
    mps(False)
    assert not sharing.mps_running()
    (tmp_path / "control").write_text("")  # a plain file is no daemon's pipe
    assert not sharing.mps_running()
    (tmp_path / "control").unlink()
    mps(True)
    assert sharing.mps_running()


def test_auto_is_async_where_the_sides_can_compute_at_once(mps, monkeypatch):
    """Claim: --mode auto is async on separate devices, on one GPU with MPS, on CPU (core groups, which the probe
    may still turn into sampling then training in one process), with several inference processes; sync on one GPU without
    MPS and on one NPU. A mode given is kept."""
    mps(False)
    assert sharing.auto_mode("cuda:0", "cuda:1")[0] == "async"
    assert sharing.auto_mode("cpu", "cpu")[0] == "async"
    assert sharing.auto_mode("cuda:0", "cuda:0", inference_workers=2)[0] == "async"
    assert sharing.auto_mode("npu:0", "npu:0") == ("sync", "one npu device for both sides: they would take turns")
    mode, why = sharing.auto_mode("cuda", "cuda:0")
    assert mode == "sync" and "without MPS" in why
    mps(True)
    assert sharing.auto_mode("cuda", "cuda:0")[0] == "async"
    one_gpu = dict(device="cuda", sizes="rule", model="tiny")
    assert derive(Config(**one_gpu)).mode == "async"
    mps(False)
    cfg = derive(Config(**one_gpu))
    assert (cfg.mode, cfg.rollout_device, cfg.train_device) == ("sync", "cuda", "cuda")
    assert derive(Config(**one_gpu, mode="async")).mode == "async"
    assert derive(Config(mode="auto", device="cpu", sizes="rule")).mode == "async"
    assert derive(Config(device="cuda", rollout_device="cuda:0", train_device="cuda:1", sizes="rule")).mode == "async"


def test_the_first_line_says_how_the_device_is_shared(mps):
    """Claim: the first line names the mode and how the device is shared: without MPS, the command that starts it
    and what it gives; with MPS, the inference side's share of the SMs (the size split, as threads split cores)."""
    mps(False)
    without = start_line(derive(Config(device="cuda", sizes="rule", model="tiny", out="o")), 90, 10)
    assert without.startswith("periodic-rl: sync (one side at a time on cuda: no NVIDIA MPS")
    assert sharing.MPS_START in without and "--mode auto then runs async" in without
    assert sharing.MPS_START in start_line(derive(Config(device="cuda", mode="async", sizes="rule", out="o")), 9, 1)
    mps(True)
    cfg = derive(Config(device="cuda", sizes="rule", model="tiny", out="o", rollout_threads=3, train_threads=5))
    assert start_line(cfg, 90, 10).startswith("periodic-rl: async (cuda shared through MPS, sampling held to 38% of")
    cpu = start_line(derive(Config(device="cpu", sizes="rule", out="o")), 90, 10)
    assert cpu.startswith("periodic-rl: async (CPU core groups")


def test_the_inference_process_alone_gets_the_mps_share(mps, monkeypatch):
    """Claim: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set only while the inference process is spawned, only where one
    GPU is shared through MPS, and a value the user set is left as it is."""
    cfg = derive(Config(device="cuda", mode="async", sizes="rule", rollout_threads=1, train_threads=3))
    mps(False)
    with sharing.mps_share(cfg):
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    mps(True)
    with sharing.mps_share(cfg):
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "70")
    with sharing.mps_share(cfg):
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    with sharing.mps_share(derive(Config(device="cpu", mode="async", sizes="rule"))):
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
