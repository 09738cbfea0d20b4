"""N inference workers per trainer (inference.py): the rollouts and the update do not depend
on N, a dead worker stops the run naming it, and the device split that balances the sides (launch/sizing.py)."""
import os
import re
import signal
import threading
import time

import pytest
import torch
from faults import Launch, hang_bound

import inference
import trainer
from infra.data import load_task
from infra.models import load_model
from infra.command_line import parse_args
from infra.reward import load_reward
from infra.timeline import Timeline
from launch import sizing
from rollout import Evaluation, ScoredGroup, IterationDone
from launch import run_output

DIGITS = "tests/rewards.py:digit_fraction"
# 8 prompts per iteration, one per generate call: worker 0 of 2 samples the even calls, worker 1 the odd ones.
# Two optimizer steps per iteration, each over 4 groups, each group its own micro-batch (its call is complete when
# it arrives), so that the order in which groups reach the trainer is the summation order of the gradient
# (with two terms per step it would not matter: a + b == b + a). The same thread count on every process (a
# worker's threads change its float rounding).
SIZES = ("--batch-size", "32", "--group-size", "4", "--groups-per-call", "1", "--micro-batch-tokens", "60",
         "--updates-per-iteration", "2", "--epsilon-low", "0.01", "--epsilon-high", "0.01",
         "--rollout-threads", "1", "--train-threads", "1")


def config(model_dir, *extra):
    reward = () if "--reward" in extra else ("--reward", DIGITS)  # --reward adds to a list: given once
    return parse_args(["--model", str(model_dir), "--data", "arithmetic", *reward, "--iterations", "3",
                       "--max-new-tokens", "6", "--eval-every", "2", "--eval-size", "4", "--eval-samples", "2",
                       "--lr", "1e-2", "--no-save", "--sizes", "rule", *SIZES, *extra])


def train(cfg):
    """θ after cfg.iterations, and the metrics rows (the run as trainer.py runs it, in this process)."""
    with trainer.started(cfg) as (rows, policy, _):
        return policy, list(rows)


def sampled(groups: list[ScoredGroup]) -> list[tuple]:
    """What a group is, without when it was sampled."""
    return [(g.iteration, g.index, g.policy_version, g.prompt_ids, g.responses, g.rewards, g.advantages, g.call)
            for g in groups]


def test_call_slices_threads_and_devices_of_the_workers():
    """Claim: worker w of trainer rank r (of M) samples the calls c with c % (M·N) == r + M·w, so the N·M workers
    cover every call exactly once; threads and devices are handed out one per worker."""
    for ranks, workers in ((1, 1), (1, 3), (2, 2)):
        slices = [s for r in range(ranks) for s in inference.worker_call_slices((r, ranks), workers)]
        owners = [[s for s, total in slices if call % total == s] for call in range(12)]
        assert all(len(owner) == 1 for owner in owners), (ranks, workers, owners)
    assert inference.owned_calls(10, 3, (0, 2)) == [0, 6] and inference.owned_calls(10, 3, (1, 2)) == [3, 9]
    assert [inference.split_threads(t, n) for t, n in ((4, 2), (3, 2), (1, 3))] == [[2, 2], [2, 1], [1, 1, 1]]
    assert inference.worker_devices("cuda:0,cuda:1", 2) == ["cuda:0", "cuda:1"]
    assert inference.worker_devices("cpu", 3) == ["cpu"] * 3


@pytest.mark.parametrize("options, message", [
    (["--inference-workers", "0"], "--inference-workers must be at least 1"),
    (["--inference-workers", "2", "--rollout-device", "cpu,cpu,cpu"], "lists 3 devices for 2 --inference-workers"),
    (["--inference-workers", "2", "--rollout-device", "cpu,gpu"], "comma-separated list"),
    (["--inference-workers", "3", "--batch-size", "16", "--group-size", "4", "--groups-per-call", "2"],
     "makes 2 of the 4 prompts"),
])
def test_bad_worker_options_are_one_line(capsys, options, message):
    """Claim: a worker count or device list that cannot work is refused in one line naming the option (a worker
    without a generate call to sample would idle for the whole run)."""
    with pytest.raises(SystemExit) as stop:
        parse_args(options)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and err.count("\n") == 1, err


def test_auto_places_each_worker_on_its_own_device(monkeypatch):
    """Claim: --device auto with N workers and more than N accelerators puts worker w on :w and the trainer on :N;
    with fewer, everything on :0; sync mode (one process) on the first device."""
    from infra import options
    monkeypatch.setattr(options, "detect_accelerator", lambda: "cuda")
    monkeypatch.setattr(options, "accelerator_count", lambda kind: 3)
    assert options.pick_devices("auto", "async", 2) == ("cuda:0,cuda:1", "cuda:2")
    assert options.pick_devices("auto", "sync", 2) == ("cuda:0", "cuda:0")
    assert options.pick_devices("auto", "async", 3) == ("cuda:0", "cuda:0")
    assert options.pick_devices("auto", "async", 1) == ("cuda:0", "cuda:1")


def test_more_workers_get_a_call_each_by_default():
    """Claim: left open, the generate calls per iteration are at least the workers (the probe, which models one
    worker, does not choose them)."""
    cfg = parse_args(["--inference-workers", "4", "--batch-size", "64", "--group-size", "4"])
    assert cfg.calls_per_iteration == 4


def group(index: int, call: tuple[int, int]) -> ScoredGroup:
    return ScoredGroup(0, index, 0, [1], [[2]], [0.0], [0.0], call=call)


def test_groups_reach_the_trainer_in_one_workers_order():
    """Claim: `in_call_order` hands over the groups of two workers in the order one worker sends them: call after
    call, each call's groups as they came, whatever the interleaving; a group waits only while an earlier call is
    incomplete; spans and evaluations pass at once; one IterationDone, after both workers' IterationDone."""
    calls = [0, 2, 4]  # three calls of two prompts: worker 0 samples calls 0 and 2 (prompts 0-1, 4-5), worker 1 call 1
    arrivals = [group(3, (2, 2)), group(1, (0, 2)), group(2, (2, 2)), IterationDone(0),  # worker 1 is done first
                group(0, (0, 2)), group(5, (4, 2)), Evaluation(0, 0, 1.0), group(4, (4, 2)), IterationDone(0)]
    merged = list(inference.in_call_order(iter(arrivals), calls, workers=2))
    assert [m.index if isinstance(m, ScoredGroup) else type(m).__name__ for m in merged] == \
           [1, 0, 3, 2, 5, "Evaluation", 4, "IterationDone"]
    released = inference.in_call_order(iter([group(1, (0, 2)), group(0, (0, 2)), group(3, (2, 2))]), calls, 1)
    assert [g.index for g in released] == [1, 0, 3]  # call 1's group goes through once call 0 is complete


@pytest.mark.slow
def test_rollouts_do_not_depend_on_the_number_of_workers(tiny_model_dir):
    """Claim: two inference workers sample exactly the groups one does (prompts, responses, rewards, advantages,
    versions: equality), over two iterations with different weights, and the trainer receives them in the same
    order; sampling the two workers' call slices one after another in this process (sync mode) gives them too."""
    cfg = config(tiny_model_dir, "--eval-every", "0")
    policy, tokenizer = load_model(cfg.model)
    examples, held_out = load_task("arithmetic", eval_size=4)
    one = inference.SyncRollouts(policy, tokenizer, examples, held_out, load_reward(DIGITS), cfg)
    slices_in_order = inference.SyncRollouts(policy, tokenizer, examples, held_out, load_reward(DIGITS), cfg,
                                            workers=2)
    with inference.AsyncRollouts(cfg.model, {}, examples, held_out, DIGITS, Timeline(), workers=2) as two:
        two.attach(policy, cfg, 2)
        assert len({w.process.pid for w in two.workers}) == 2
        for iteration in range(2):
            received = []
            for rollouts in (one, slices_in_order, two):
                rollouts.publish(policy, iteration)
                rollouts.generate(iteration)
                received.append([m for m in rollouts.receive() if isinstance(m, ScoredGroup)])
            assert len(received[0]) == cfg.prompts_per_iteration
            assert sampled(received[1]) == sampled(received[0])
            assert sampled(received[2]) == sampled(received[0])
            with torch.no_grad():  # a new version: the next iteration samples from other weights
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
    assert not any(w.process.is_alive() for w in two.workers)


@pytest.mark.slow
def test_training_does_not_depend_on_the_number_of_workers(tiny_model_dir):
    """Claim: a run with two inference workers is bitwise the run with one: the same metrics and, after three
    iterations of two optimizer steps each, the same weights (torch.equal), although worker 0 is made slow (its
    reward waits 0.1 s per response), so that worker 1's groups (odd calls) arrive before worker 0's (even calls). Exact because the trainer takes the groups in one worker's order (in_call_order), so the micro-batches
    and the gradient's summation order are those of one worker. (Taking them in arrival order instead, the same
    test gave different weights: the sums ran in another order.)"""
    slow = ("--reward", "tests/rewards.py:digit_fraction_worker_0_slow")  # the same values in every process
    reference, reference_rows = train(config(tiny_model_dir, "--mode", "sync", *slow))
    initial, _ = load_model(str(tiny_model_dir))
    assert max((p - q).abs().max().item() for p, q in zip(reference.parameters(), initial.parameters())) > 1e-3
    for mode in ("async", "sync"):
        policy, rows = train(config(tiny_model_dir, "--mode", mode, "--inference-workers", "2", *slow))
        assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), reference.parameters())), mode
        assert len(rows) == len(reference_rows) == 4
        for row, expected in zip(rows, reference_rows):
            for key in ("reward_mean", "reward_std", "response_length", "eval_reward", "kl", "clip_fraction", "loss",
                        "grad_norm"):
                assert row.get(key) == expected.get(key), (mode, key)


# --- failures: python trainer.py in a subprocess ---
ENDLESS = ("--data", "arithmetic", "--iterations", "1000", "--batch-size", "16", "--group-size", "4",
           "--max-new-tokens", "4", "--eval-every", "0", "--groups-per-call", "2", "--micro-batch-tokens", "16384",
           "--rollout-threads", "2", "--train-threads", "1", "--inference-workers", "2", "--no-save")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through Linux's /proc")
@pytest.mark.parametrize("how", ["kill-worker", "ctrl-c"])
def test_a_dead_worker_or_ctrl_c_stops_every_process(tiny_model_dir, tmp_path, how):
    """Claim: with two inference workers, SIGKILL to one of them stops the run within 10 s with one line naming that
    worker (its index and PID) and the signal; Ctrl-C stops it with the interrupted line. Either way no worker,
    no other process of the run and nothing in /dev/shm is left behind (faults.Launch.assert_stopped)."""
    with Launch("--model", tiny_model_dir, *ENDLESS, "--out", tmp_path) as run:
        run.wait_for(r"^iter ")
        workers = run.inference_pids()
        assert len(workers) == 2
        if how == "kill-worker":
            run.send(signal.SIGKILL, to=workers[-1])
            line = run.assert_stopped(1, rf"^error: inference worker [01] of 2 \(PID {workers[-1]}\) died: killed by "
                                         r"SIGKILL").strip().splitlines()[-1]
            assert re.search(r"worker (\d)", line)[1] == "1", "the second worker spawned is worker 1"
        else:
            run.send(signal.SIGINT, group=True)  # what the terminal does
            run.assert_stopped(130, r"^interrupted by SIGINT")


# --- the split of devices (point 6) ---
def test_balanced_split():
    """Claim: the split that balances the sides gives the slower side more devices, in proportion: inference 2.7x
    slower than training on 8 devices is 6 + 2 (6 workers at 2.7/6 = 0.45 against 2 trainers at 1/2 = 0.5; 5 + 3
    would leave inference at 0.54); equal sides split evenly; the slower side never takes every device."""
    assert sizing.balanced_split(2.7, 1.0, 8) == (6, 2)
    assert sizing.balanced_split(1.0, 2.7, 8) == (2, 6)
    assert sizing.balanced_split(1.0, 1.0, 4) == (2, 2)
    assert sizing.balanced_split(100.0, 1.0, 4) == (3, 1)
    assert sizing.balanced_split(1.0, 1.0, 2) == (1, 1)
    with pytest.raises(ValueError):
        sizing.balanced_split(1.0, 1.0, 1)
    cfg = parse_args(["--inference-workers", "2"])
    line = run_output.device_split(cfg, [(9.0, 9.0), (5.4, 2.0), (5.4, 2.0)])  # the first iteration is dropped
    assert "with 8 devices, 6 inference + 2 training" in line and "(this run: 2 + 1)" in line
    line = sizing.split_report(5.4, 2.0, 1, 1)
    assert "inference 2.7x slower than training" in line and "with 8 devices, 6 inference + 2 training" in line
    assert "with 2 devices, 1 inference + 1 training, 7.4 s per iteration (this run: 1 + 1)" in line  # no overlap
    assert "with 8 devices, 6 inference + 2 training, 1.9 s per iteration" in line  # 6 calls at once, then training


def test_a_worker_spawn_holds_ctrl_c_off_for_its_fork_and_exec_alone(tiny_model_dir, monkeypatch):
    """Claim: the trainer ignores SIGINT while it starts a worker (so the child is born ignoring it through its
    imports), and a Ctrl-C in that block is lost: so the block ends as soon as the child exists, before the child
    has imported torch, however many prompts the run has (they go with ("attach", ...), not as the process's
    arguments). Checked by the child's memory map: no libtorch at the block's end;
    then it does map it, and attaches and samples as usual."""
    import contextlib
    cfg = config(tiny_model_dir)
    train, held_out = [[7] * 60 for _ in range(40_000)], [[7] * 60 for _ in range(64)]  # distinct: pickled each
    ends = []

    @contextlib.contextmanager
    def timed_block():
        with real_block():
            yield
        ends.append(open(f"/proc/{spawned[-1].pid}/maps").read())

    real_block, spawned = inference.sigint_ignored, []
    process_class = inference.mp.get_context("spawn").Process
    real_start = process_class.start
    monkeypatch.setattr(inference, "sigint_ignored", timed_block)
    monkeypatch.setattr(process_class, "start", lambda process: spawned.append(process) or real_start(process))
    with inference.AsyncRollouts(cfg.model, {}, train, held_out, DIGITS, Timeline(), load=False) as remote:
        assert len(ends) == 1 and "libtorch" not in ends[0], "the block waited for the child's imports"
        remote.wait_until_loaded()
        assert "libtorch" in open(f"/proc/{spawned[-1].pid}/maps").read()


class SlowPipe:
    """A connection whose sends block until `opened` is set (a trainer that stopped reading), recording them."""

    def __init__(self):
        self.sent, self.opened, self.sending = [], threading.Event(), threading.Event()

    def send(self, message):
        self.sending.set()
        self.opened.wait()
        self.sent.append(message)


def test_the_outbox_sender_ends_before_the_process_exits():
    """Claim: Outbox.close ends the sender thread, which is a daemon: one left inside a send (pickling tensors) while
    the interpreter finalizes can abort the process, as the heartbeat did (Heartbeat). Plain close sends what is
    pending, then the thread ends; close(discard=True), after Ctrl-C, drops what is not sent yet; and against a
    trainer that stopped reading (a send blocked on a full pipe) close returns after its timeout instead of hanging."""
    from infra.processes import Outbox
    pipe = SlowPipe()
    pipe.opened.set()
    outbox = Outbox(pipe)
    for k in range(3):
        outbox.put(k)
    outbox.close()
    assert pipe.sent == [0, 1, 2] and not outbox.thread.is_alive()

    stuck = SlowPipe()
    outbox = Outbox(stuck)
    for k in range(3):
        outbox.put(k)
    assert stuck.sending.wait(5)  # the sender is inside the send of 0
    start = time.monotonic()
    outbox.close(discard=True, timeout=0.3)
    assert 0.25 < time.monotonic() - start < hang_bound(5) and outbox.thread.is_alive()  # blocked in the send of 0
    joins = []
    outbox.thread.join = joins.append  # counts the waits
    outbox.close(timeout=0.3)  # again (inference_process's finally after its Ctrl-C branch): the wait is not repeated
    del outbox.thread.join
    assert joins == []
    stuck.opened.set()  # the pipe drains: 0 goes out, 1 and 2 were dropped, and the thread ends
    outbox.thread.join(5)
    assert stuck.sent == [0] and not outbox.thread.is_alive()


class StopAt:
    """A trainer's end of the pipe that answers ("stop",) to the `at`-th command read, after ("load",) ones."""

    def __init__(self, at: int = 1):
        self.sent, self.left = [], at

    def recv(self):
        self.left -= 1
        return ("stop",) if self.left <= 0 else ("load",)

    def send(self, message):
        self.sent.append(message)


@pytest.mark.parametrize("at", [1, 2])
def test_an_inference_process_ends_its_threads_before_it_exits(at, monkeypatch, tiny_model_dir):
    """Claim: inference_process stops its heartbeat and its sender thread (Heartbeat, Outbox.close) on the way out,
    whichever command ends it (a stop before loading, or after), and what it put is sent first ("loaded"). Both are
    daemon threads; one left running inside a torch call or a send while the interpreter finalizes aborts the
    process (SIGABRT). Run in this process (the entry point as a function), with the parent watch left out."""
    import transformers
    monkeypatch.setattr(inference, "die_with_parent", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # this process's count stays
    monkeypatch.setattr(transformers.utils.logging, "disable_progress_bar", lambda: None)
    before = set(threading.enumerate())
    pipe = StopAt(at)
    inference.inference_process(str(tiny_model_dir), {}, pipe, torch.zeros(1), ["math"], None, takes_sigint=False)
    assert pipe.sent == [("loaded", None)] * (at - 1)
    left = [thread.name for thread in set(threading.enumerate()) - before if thread.is_alive()]
    assert "heartbeat" not in left and "outbox" not in left, left


def test_a_stop_ends_the_workers_at_once():
    """Claim: leaving the inference side's `with` block on a stop signal (Interrupted, a KeyboardInterrupt) sends
    every worker SIGTERM at once, without asking it to stop and waiting for it to finish its command (seconds on a
    busy machine, for samples nothing keeps); leaving it otherwise (the run's end, an error) still asks first."""
    from infra.stopping import Interrupted

    class Worker:
        failed, calls = False, []

        def ask_to_stop(self):
            self.calls.append("ask")

        def end(self, wait, terminate):
            self.calls.append(("end", wait, terminate))
    polite = ["ask", "ask"] + [("end", True, True)] * 2
    for kind, expected in ((Interrupted, [("end", False, True)] * 2), (None, polite), (ValueError, polite)):
        rollouts = object.__new__(inference.AsyncRollouts)
        rollouts.workers, rollouts.weights, rollouts.loaded, Worker.calls = [Worker(), Worker()], None, True, []
        rollouts.__exit__(kind, None, None)
        assert Worker.calls == expected, kind
