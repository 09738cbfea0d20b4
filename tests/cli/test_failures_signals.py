"""Processes and signals: whatever stops a run, it ends with one line, within 10 s,
leaving no process and nothing in /dev/shm behind (`faults.Launch.assert_stopped` checks all of that)."""
import os
import signal
import time

import pytest
from faults import Launch, hang_bound

pytestmark = [pytest.mark.slow,  # process-level: `python -m pytest -m slow` (CI runs both tiers)
              pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through Linux's /proc")]

# Small, fixed sizes (no probe): a run of 1000 iterations that only a signal ends.
ENDLESS = ("--data", "arithmetic", "--iterations", "1000", "--batch-size", "16", "--group-size", "4",
           "--max-new-tokens", "4", "--eval-every", "0", "--groups-per-call", "2", "--micro-batch-tokens", "16384",
           "--rollout-threads", "1", "--train-threads", "1", "--no-save")


def endless(model_dir, out, *extra, **launch) -> Launch:
    return Launch("--model", model_dir, *ENDLESS, "--out", out, *extra, **launch)


@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)],
                         ids=["SIGTERM", "SIGTERM-group", "SIGHUP-group"])
def test_signal_mid_run_stops_like_ctrl_c(tiny_model_dir, tmp_path, signum, group):
    """Claim: SIGTERM (kill, timeout, Slurm, docker stop) and SIGHUP (terminal closed), to the trainer or to its
    whole process group, stop the run as Ctrl-C does: one line naming the signal, exit code 128 + signal,
    within 10 s, no process and no semaphore or segment in /dev/shm left behind (SIGHUP to the group also kills
    multiprocessing's resource tracker, which then could not remove a Queue's semaphores). Without --save-every or
    --save-on-stop the line says that the iterations done were not saved, and which option keeps them."""
    with endless(tiny_model_dir, tmp_path) as run:
        run.wait_for(r"^iter ")
        run.send(signum, group=group)
        run.assert_stopped(128 + signum, rf"^interrupted by {signal.Signals(signum).name}: the run was stopped, "
                                         r"nothing is left running; the \d+ iterations? done (were|was) not saved "
                                         r"\(--save-on-stop keeps them")


def test_killed_trainer_takes_its_inference_process_along(tiny_model_dir, tmp_path):
    """Claim: SIGKILL to the trainer (nothing can be handled) still leaves nothing running: the inference process
    dies with its parent, and multiprocessing's resource tracker with them; nothing is left in /dev/shm."""
    with endless(tiny_model_dir, tmp_path) as run:
        run.wait_for(r"^iter ")
        run.send(signal.SIGKILL)
        run.assert_stopped(-signal.SIGKILL, None)


def test_ctrl_c_ignored_by_the_launcher_is_ignored_by_every_process(tiny_model_dir, tmp_path):
    """Claim: a run started with SIGINT ignored (`nohup ... &`, or a background job of a script) ignores Ctrl-C in
    every process, its two inference workers included: SIGINT to the whole process group changes nothing (the
    workers are the same processes and iterations go on), and SIGTERM then stops it as usual. (The workers once
    took SIGINT back: they died of it, and the trainer, which ignores it, ended with "worker died: exit code
    130".)"""
    with endless(tiny_model_dir, tmp_path, "--inference-workers", "2", ignored=(signal.SIGINT,)) as run:
        run.wait_for(r"^iter ")
        workers = run.inference_pids()
        run.send(signal.SIGINT, group=True)
        done = len([line for line in run.stdout if line.startswith("iter ")])
        run.wait_for(rf"^iter\s+{done + 1}\b")  # two more iterations after the signal
        run.wait_for(rf"^iter\s+{done + 2}\b")
        assert run.process.poll() is None and run.inference_pids() == workers, "\n".join(run.stderr)
        run.send(signal.SIGTERM)
        run.assert_stopped(143, r"^interrupted by SIGTERM")


@pytest.mark.parametrize("delay", [0.3, 1.5, 4.0])
def test_ctrl_c_at_any_moment_of_start_up(tiny_model_dir, tmp_path, delay):
    """Claim: Ctrl-C while the trainer imports, spawns or loads is never swallowed (once it went on and crashed in
    a half-imported numpy): the run stops with the interrupted line and exit code 130."""
    import time
    with endless(tiny_model_dir, tmp_path, warm=False) as run:  # a fresh interpreter: its imports are the claim
        time.sleep(delay)
        run.send(signal.SIGINT, group=True)  # what the terminal does
        run.assert_stopped(130, r"^interrupted by SIGINT")


@pytest.mark.parametrize("signum, message", [
    (signal.SIGKILL, r"^error: the inference process \(PID \d+\) died: killed by SIGKILL"),
    (signal.SIGSTOP, r"^error: the inference process \(PID \d+\) is stopped \(state T"),
], ids=["SIGKILL", "SIGSTOP"])
def test_inference_process_killed_or_stopped_is_reported(tiny_model_dir, tmp_path, signum, message):
    """Claim: an inference process killed by a signal is reported with that signal's name, and one stopped by
    SIGSTOP (or frozen) is reported instead of hanging the run forever: exit code 1 within 10 s, no leftovers."""
    with endless(tiny_model_dir, tmp_path) as run:
        run.wait_for(r"^iter ")
        run.send(signum, to=run.inference_pid())
        run.assert_stopped(1, message)


def test_inference_process_without_heartbeat_is_reported_as_hung(tiny_model_dir, monkeypatch):
    """Claim: an inference process whose heartbeat stops (a thread counting once a second, which keeps counting
    during `generate`) is reported as hung after FROZEN_SECONDS instead of hanging the run forever; here a reward
    stuck in a native call that holds the GIL, with the limit shortened from 60 s to 3 s (past --reward-timeout,
    here 0: no limit; a reward's own clock comes first where it can stop the call)."""
    import dataclasses
    import time

    import inference
    from infra.data import load_task
    from infra.models import load_model
    from infra.command_line import parse_args
    monkeypatch.setattr(inference, "FROZEN_SECONDS", 3.0)
    cfg = dataclasses.replace(parse_args(["--model", str(tiny_model_dir), *ENDLESS, "--reward-timeout", "0"]),
                              max_new_tokens=2)
    policy, _ = load_model(cfg.model)
    train, held_out = load_task("arithmetic", eval_size=4)
    remote = inference.AsyncRollouts(cfg.model, {}, train, held_out, "tests/faults.py:frozen_reward")
    try:
        remote.attach(policy, cfg, 1)
        remote.publish(policy, 0)
        remote.generate(0)
        start = time.monotonic()
        with pytest.raises(inference.PipelineError, match=r"\(PID \d+\) has shown no sign of life for \d+ s"):
            list(remote.receive())
        assert time.monotonic() - start < hang_bound(10)
    finally:
        remote.close()
    assert not remote.workers[0].process.is_alive()


def test_the_heartbeat_stops_before_the_worker_exits():
    """Claim: the inference process's heartbeat thread, stopped as the process ends (`Heartbeat.stop`, in
    `inference_process`'s `finally`), is no longer inside a torch call when the interpreter finalizes. A daemon
    thread caught there aborts the process at exit ("terminate called without an active exception", SIGABRT),
    even after a normal run. Here the thread beats without pause, so that a thread left running is nearly always
    caught (most such exits abort); three processes
    that each stop it just before exiting must all exit 0 without that line. (This checks Heartbeat.stop; that
    inference_process calls it is read in its `finally`, not tested.)"""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from infra.processes import Heartbeat
    counter = torch.zeros(1, dtype=torch.int64)
    heart = Heartbeat(counter, seconds=0.0)
    deadline = time.monotonic() + 60
    while int(counter[0]) < 100 and time.monotonic() < deadline:
        time.sleep(0.001)
    heart.stop()
    assert not heart.thread.is_alive()
    stopped_at = int(counter[0])
    time.sleep(0.01)
    assert int(counter[0]) == stopped_at
    script = ("import time, torch\nfrom infra.processes import Heartbeat\n"
              "heart = Heartbeat(torch.zeros(1, dtype=torch.int64), seconds=0.0)\ntime.sleep(0.05)\nheart.stop()\n")
    runs = [subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                             stderr=subprocess.PIPE, text=True) for _ in range(3)]
    ended = [(run.wait(timeout=60), run.stderr.read()) for run in runs]
    assert all(code == 0 and "terminate called" not in err for code, err in ended), ended


def test_sigterm_during_the_tiny_model_build_leaves_no_building_folder(tmp_path):
    """Claim: SIGTERM while the tiny model is being built (first run, ~1 min) stops the run within 10 s and removes
    the half-built `.building-*` folder from the cache."""
    cache = tmp_path / "cache"
    with Launch("--model", "tiny", *ENDLESS, "--out", tmp_path / "out", "--cache-dir", cache) as run:
        import time
        deadline = time.monotonic() + 120
        while not list(cache.glob(".building-*")):
            assert time.monotonic() < deadline and run.process.poll() is None, "\n".join(run.stderr)
            time.sleep(0.2)
        time.sleep(2)  # well into the warm-up
        run.send(signal.SIGTERM)
        run.assert_stopped(128 + signal.SIGTERM, r"^interrupted by SIGTERM")
    assert [path.suffix for path in cache.iterdir()] == [".lock"]  # the builders' lock file, unlocked


def test_a_killed_builds_folder_is_swept_by_the_next_build(tmp_path):
    """Claim: SIGKILL runs no clean-up, so the next build removes the `.building-*` folders of this host whose
    builder is gone, and leaves alone those of a live one."""
    import socket
    import subprocess

    from infra.tiny import sweep_stale_builds
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    dead, live = tmp_path / f".building-{host}-{gone.pid}-abc", tmp_path / f".building-{host}-{os.getpid()}-def"
    for folder in (dead, live):
        (folder / "part").mkdir(parents=True)
    sweep_stale_builds(tmp_path)
    assert not dead.exists() and live.exists()


FULL_SHM = """
import torch, weights
weights.check_shared_memory = lambda nbytes: None  # as if /dev/shm filled up after the check
try:
    weights.WeightBuffer(torch.nn.Linear(2000, 2000))  # 15 MiB
except weights.SharedMemoryError as error:
    print("error:", error)
"""


def test_a_full_dev_shm_leaves_no_torch_segment(tmp_path):
    """Claim: when a shared-memory allocation fails for want of room in /dev/shm (here a 1 MiB one, in a mount
    namespace of its own), the error is one line and the `torch_*` file torch leaves behind is removed."""
    import shutil
    import subprocess
    import sys

    from faults import ROOT
    if not shutil.which("unshare") or subprocess.run(["unshare", "--map-root-user", "--mount", "true"]).returncode:
        pytest.skip("needs unshare with user and mount namespaces (a private /dev/shm)")
    script = tmp_path / "full_shm.py"
    script.write_text(FULL_SHM)
    result = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c",
         f"mount -t tmpfs -o size=1m tmpfs /dev/shm && {sys.executable} {script} && ls -A /dev/shm"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("error: could not allocate 15.3 MiB of shared memory") and "--shm-size" in lines[0]


def test_killed_torchrun_takes_its_ranks_along(tiny_model_dir, tmp_path):
    """Claim: SIGKILL to torchrun (which starts each rank in a session of its own) leaves nothing
    running: each rank dies with its launcher (parent-death signal, distributed.die_with_launcher), its inference
    process with it, the resource trackers after them; metrics.jsonl stops growing (ranks went on training and
    writing --out 15 s later)."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    with Launch("--model", tiny_model_dir, *ENDLESS, "--out", tmp_path, launcher=torchrun) as run:
        run.wait_for(r"^iter +1 ")
        assert len(run.tree) >= 6, run.tree  # 2 ranks, their inference processes and resource trackers
        run.send(signal.SIGKILL)
        run.assert_stopped(-signal.SIGKILL, None)
        rows = (tmp_path / "metrics.jsonl").read_text()
        time.sleep(2)
        assert (tmp_path / "metrics.jsonl").read_text() == rows


FROM_C = ("-c", "import sys, trainer; sys.exit(trainer.main(sys.argv[2:]))")  # `python -c`: no script to re-import


@pytest.mark.parametrize("mode, starts, launcher", [("sync", "fork,spawn,forkserver", ()), ("async", "fork", ()),
                                                    ("async", "fork", FROM_C)],
                         ids=["sync", "async", "async-python-c"])
def test_killed_trainer_takes_a_rewards_own_processes_along(tiny_model_dir, tmp_path, mode, starts, launcher):
    """Claim: a reward that keeps process pools of its own (started by fork, spawn and a forkserver; in the trainer
    in sync mode, in the inference process in async mode) leaves no worker behind when the trainer is SIGKILLed,
    also when the run was started from `python -c` (or a script on stdin: `trainer.train`), whose spawned inference
    process imports no main module: there, pools started by fork (and a forkserver's) are covered, not spawned ones
    (a spawned child of such a process imports nothing of ours that could watch its parent)."""
    with endless(tiny_model_dir, tmp_path, "--mode", mode, "--reward", "tests/rewards.py:kept_pool_length",
                 env={"REWARD_POOL_START": starts}, launcher=launcher) as run:
        run.wait_for(r"^iter ")
        run.send(signal.SIGKILL)
        run.assert_stopped(-signal.SIGKILL, None)
