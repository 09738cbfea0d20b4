"""Trainer ranks (infra/distributed.py): torchrun with M = 2 ranks on CPU (gloo) is the single-process run, and fails cleanly.

Tolerances, from the arithmetic (the ranks change only the order of float sums: each rank sums its own groups'
gradients, then the all-reduce adds the ranks' sums):
- rollouts equal exactly: every generate call is seeded per call (rollout.prompt_seed), whichever rank samples it,
  and the weights agree to ~1e-6 of their movement (below), so a sampled token would change only if a uniform draw
  fell within that of a CDF boundary. Checked on reward mean / std (over the groups in index order), response
  length and held-out reward, all exact (==).
- loss, grad_norm, kl, clip fraction within 1e-4 relative: float32 sums of n ~ 10^2-10^3 terms, n·2^-24 <= 6e-5.
- final weights: ‖θ_ranks − θ_single‖₂ <= 1e-3 · ‖θ_single − θ_0‖₂. Not elementwise: Adam divides each gradient
  element by its own magnitude, so an element whose gradient is at the rounding-noise level may step either way
  by up to lr (test_pipeline.test_async_matches_sync_across_thread_counts says the same). Measured in the
  setups below (3 iterations, lr 1e-2): the single process's own sensitivity to summation order, by regrouping
  its micro-batches (--micro-batch-tokens 60 vs 1000, same math), 3.4e-6 of the movement; the ranks 6.2e-6
  ("5 calls") and 0 ("2 mini-batches": each mini-batch is one rank's whole, so the sums are the same sums).
  1e-3 leaves a margin of 160x, while a step in a wrong direction changes every element's step by O(lr):
  gradients not summed over the ranks measured 0.97 of the movement. A wrong *scale* (a rank-local normaliser
  D) hardly shows in Adam's weights (6.7e-3 measured), which is why the loss and gradient-norm rows are
  compared too (1.77 vs 2.95 there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import faults
from conftest import once_per_session
import pytest
import torch
from safetensors.torch import load_file

import trainer
from infra.distributed import Ranks, from_environment
from learner import Learner
import warm


ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
EXACT = ("reward", "reward_std", "completions/mean_length", "eval_reward")  # metrics.jsonl's keys
SUMS = ("loss", "grad_norm", "kl", "clip_ratio/region_mean")
# 5 prompts in calls of 1 (rank 0 trains 3 groups, rank 1 two), or 4 prompts in calls of 2 with two mini-batches
# (each mini-batch is one call's: each rank has none of the other mini-batch's groups and still joins its step),
# rewards scaled by the whole batch's std and a KL term (the batch's std and the reference's log-probs cross ranks)
SETUPS = {"5 calls": ["--batch-size", "20", "--groups-per-call", "1"],
          "2 mini-batches": ["--batch-size", "16", "--groups-per-call", "2", "--updates-per-iteration", "2",
                             "--epsilon-low", "0.01", "--epsilon-high", "0.01", "--scale-rewards", "batch",
                             "--beta", "0.04"]}


def options(model_dir, out, setup: str, *extra) -> list[str]:
    return ["--model", model_dir, "--data", "arithmetic", "--reward", "tests/rewards.py:digit_fraction",
            "--iterations", "3", "--group-size", "4", "--max-new-tokens", "6", "--eval-every", "2", "--eval-size", "4",
            "--eval-samples", "2", "--lr", "1e-2", "--micro-batch-tokens", "60", "--rollout-threads", "1",
            "--train-threads", "1", "--out", out, *SETUPS[setup], *extra]


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = warm.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def result(out: Path) -> tuple[list[dict], torch.Tensor]:
    """(metrics rows, the saved policy's parameters as one float64 vector)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(out / "policy" / "model.safetensors")
    return rows, torch.cat([weights[name].reshape(-1).double() for name in sorted(weights)])


@pytest.fixture(scope="session")
def single_process(tiny_model_dir, tmp_path_factory):
    """The single-process run of each setup, run once for the session (conftest.once_per_session) and compared
    with every ranks run of that setup, here and in test_inference_ranks.py."""
    def get(setup: str):
        return result(once_per_session(tmp_path_factory, f"single-process-{setup.replace(' ', '-')}",
                                       lambda out: run([sys.executable, "trainer.py",
                                                        *options(tiny_model_dir, out, setup)])))
    return get


def assert_same_run(single: tuple, ranks: tuple, initial: torch.Tensor) -> None:
    (single_rows, single_weights), (ranks_rows, ranks_weights) = single, ranks
    assert len(single_rows) == len(ranks_rows) == 4
    for s, r in zip(single_rows, ranks_rows):
        for key in EXACT:
            assert s.get(key) == r.get(key), (key, s, r)
        for key in SUMS:
            assert r.get(key) == (None if s.get(key) is None else pytest.approx(s[key], rel=1e-4, abs=1e-7)), key
    moved = (single_weights - initial).norm()
    assert moved > 1e-2, "training did not move the weights: the comparison would be vacuous"
    assert (ranks_weights - single_weights).norm() <= 1e-3 * moved


def initial_weights(model_dir) -> torch.Tensor:
    weights = load_file(Path(model_dir) / "model.safetensors")
    return torch.cat([weights[name].reshape(-1).double() for name in sorted(weights)])


@pytest.mark.slow  # process-level: torchrun
def test_two_ranks_equal_the_single_process(tiny_model_dir, single_process, tmp_path):
    """Claim: `torchrun --nproc-per-node 2` gives the single-process run's rollouts exactly and its update up to
    float summation order (tolerances: module docstring), with 2 updates per iteration where each rank has none of
    one mini-batch's groups (and still joins its step), rewards scaled by the whole batch's std (--scale-rewards
    batch) and a KL term (--beta 0.04); rank 0 alone logs (one line per iteration, not one per rank); every rank
    ends with the same θ (else the run fails: distributed.check_same_weights). One update per iteration, with
    unequal groups per rank: the next test. And rank 0's checkpoint is every rank's: resumed at iteration 2 by 2
    ranks (in sync mode, which with equal thread counts is async's run bit for bit: tests/method/test_pipeline.py),
    the run ends with bitwise the same weights and the same last row."""
    done = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "trainer.py",
                *options(tiny_model_dir, tmp_path / "run", "2 mini-batches", "--save-every", "2",
                         "--collective-timeout", "120")])
    assert sum(line.startswith("iter ") for line in done.stdout.splitlines()) == 3, done.stdout
    ranks = result(tmp_path / "run")
    assert_same_run(single_process("2 mini-batches"), ranks, initial_weights(tiny_model_dir))
    assert max(row["clip_ratio/region_mean"] for row in ranks[0][:-1]) > 0, "2 updates should activate clipping"
    run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "trainer.py", "--resume",
         tmp_path / "run" / "checkpoint-2", "--out", tmp_path / "resumed", "--mode", "sync"])
    resumed = result(tmp_path / "resumed")
    assert torch.equal(resumed[1], ranks[1])
    last = next(row for row in resumed[0] if row["iteration"] == 2)
    assert all(last[key] == ranks[0][2][key] for key in (*EXACT, *SUMS)), (last, ranks[0][2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_nodes(rdzv_id: str, node_options: list[list], nproc_per_node: int = 1) -> Iterator[list[subprocess.Popen]]:
    """Two torchrun launches on localhost, as two "nodes" meeting at one c10d rendezvous; node i runs trainer.py
    with node_options[i]. Each in a session of its own, killed whole on the way out (a failed test leaves none)."""
    port = free_port()
    launches = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", rdzv_id, "trainer.py",
         *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for node, extra in enumerate(node_options)]
    try:
        yield launches
    finally:
        for launch in launches:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()


@pytest.mark.slow  # process-level: torchrun
def test_two_nodes_of_two_inference_workers_equal_the_single_process(tiny_model_dir, single_process, tmp_path):
    """Claim: two torchrun launches of one rank each, as two "nodes" meeting at one c10d rendezvous on localhost,
    each rank with two inference workers (M = 2 x N = 2, async), are the same run as the single process: its
    rollouts exactly and its update up to float summation order (module docstring). One update per iteration and 5
    calls of one prompt: rank 0 owns calls 0, 2, 4 and rank 1 calls 1, 3; the four workers sample calls {0, 4},
    {2}, {1}, {3} (call slice r + M·w of M·N), each seeded per call as in the single process. (Ranks in sync mode:
    test_two_ranks_equal_the_single_process's resume, and tests/cli/test_completions.py.)"""
    node = options(tiny_model_dir, tmp_path, "5 calls", "--inference-workers", "2")
    with two_nodes("two-nodes", [node] * 2) as launches:
        for launch in launches:
            out, err = launch.communicate(timeout=300)
            assert launch.returncode == 0, err[-3000:]
            if launch is launches[0]:
                assert sum(line.startswith("iter ") for line in out.splitlines()) == 3, out
    assert_same_run(single_process("5 calls"), result(tmp_path), initial_weights(tiny_model_dir))


def test_learner_expects_only_its_ranks_groups(tiny_model_dir):
    """Claim: rank r expects the groups of the calls c % M == r in each mini-batch, and together the ranks expect
    every group once (4 prompts, calls of 2, two mini-batches: each rank owns one mini-batch whole)."""
    from infra.command_line import parse_args
    cfg = parse_args(["--model", str(tiny_model_dir), "--batch-size", "16", "--group-size", "4",
                      "--groups-per-call", "2", "--updates-per-iteration", "2", "--sizes", "rule"])
    expected = [Learner(None, None, cfg, torch.device("cpu"), None, Ranks(rank, 2)).groups_per_minibatch
                for rank in (0, 1)]
    assert expected == [[2, 0], [0, 2]]
    assert Learner(None, None, cfg, torch.device("cpu"), None).groups_per_minibatch == [2, 2]
    assert from_environment({}) == Ranks()
    assert from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == \
        Ranks(3, 4, 1, 2)


def test_each_rank_gets_its_devices_and_only_rank_0_writes(monkeypatch):
    """Claim: on a node with 8 GPUs and 4 ranks, local rank l trains on cuda:l and samples on cuda:4+l (with 4 GPUs
    both on cuda:l); devices given by option stay as given; ranks other than 0 save nothing and write no trace."""
    from infra.distributed import place
    from infra.command_line import parse_args
    cfg = dataclasses.replace(parse_args(["--sizes", "rule", "--trace", "t.json"]), device="auto",
                              train_device="cuda:1", rollout_device="cuda:0")  # as derive picks with >= 2 GPUs
    for gpus, expected in ((8, ("cuda:2", "cuda:6")), (4, ("cuda:2", "cuda:2"))):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        placed = place(cfg, Ranks(2, 4, 2, 4), given=set())
        assert (placed.train_device, placed.rollout_device) == expected
        assert placed.save is False and placed.trace is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert place(cfg, Ranks(0, 4, 0, 4), given={"rollout_device"}).rollout_device == "cuda:0"
    assert place(cfg, Ranks(0, 4, 0, 4), given=set()).trace == "t.json"


def test_every_worker_of_every_rank_gets_calls_and_a_device(monkeypatch):
    """Claim: with M ranks x N workers the rule's sizes are cut so that every worker has a generate call (the rule's
    one call per iteration on a GPU would leave every rank but rank 0 idle), on a node with L·(1+N) GPUs each worker
    of local rank l samples on its own cuda:L+l·N+w, and sizes given by option that leave a worker idle are refused
    in one line."""
    from infra.distributed import check, place
    from infra.liveness import RanksError
    from infra.command_line import parse_args
    cfg = dataclasses.replace(parse_args(["--sizes", "rule", "--inference-workers", "3"]), device="auto",
                              train_device="cuda:1", rollout_device="cuda:0", groups_per_call=16)  # the GPU rule
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    placed = [place(cfg, Ranks(rank, 2, rank, 2), given=set()) for rank in range(2)]
    assert [(p.train_device, p.rollout_device) for p in placed] == [("cuda:0", "cuda:2,cuda:3,cuda:4"),
                                                                     ("cuda:1", "cuda:5,cuda:6,cuda:7")]
    assert all(p.groups_per_call == 16 // 6 and p.calls_per_iteration >= 6 for p in placed)
    for p, rank in zip(placed, range(2)):
        check(p, Ranks(rank, 2, rank, 2))
    with pytest.raises(RanksError, match=r"--groups-per-call 4 makes 4 generate calls per iteration, fewer than "
                                         r"the 2 ranks x 3 inference workers .* give --groups-per-call 2 or less"):
        check(place(dataclasses.replace(cfg, groups_per_call=4), Ranks(0, 2, 0, 2), given={"groups_per_call"}),
              Ranks(0, 2, 0, 2))


def test_probing_sizes_with_inference_ranks_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Claim: `--sizes probe` on CPU with inference ranks is refused in one line, before any process group or model
    (the probe models a local inference process); with trainer ranks alone it passes the check (rank 0 probes and
    shares the sizes: the next test)."""
    from infra.distributed import check
    from infra.command_line import parse_args
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert trainer.main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "--inference-ranks", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: trainer rank 0 of 1: --sizes probe does not work with inference ranks") and \
        err.count("\n") == 1, err
    open_sizes = parse_args(["--model", str(tiny_model_dir)])
    assert not open_sizes.sized
    check(open_sizes, Ranks(0, 2, 0, 2))  # no refusal


@pytest.mark.slow  # process-level: torchrun
def test_two_ranks_on_cpu_run_with_no_sizes_given(tiny_model_dir, tmp_path):
    """Claim: `torchrun --nproc-per-node 2 trainer.py` on CPU with no size given runs: trainer rank 0 alone
    probes (one probe line; --sizes probe is the default) and sends its sizes to rank 1, at least one generate call
    per rank; every rank uses them (a rank with other calls would wait for groups it never gets, until the
    timeout), and config.json records them."""
    done = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "trainer.py", "--model", tiny_model_dir,
                "--data", "arithmetic", "--iterations", "2", "--batch-size", "16", "--group-size", "4",
                "--max-new-tokens", "4", "--eval-every", "0", "--collective-timeout", "120", "--out", tmp_path])
    assert sum(line.startswith("iter ") for line in done.stdout.splitlines()) == 2, done.stdout
    assert done.stdout.count("periodic-rl: probe:") == 1, done.stdout
    record = json.loads((tmp_path / "config.json").read_text())
    assert all(record[name] for name in ("groups_per_call", "micro_batch_tokens", "rollout_threads", "train_threads"))
    assert -(-4 // record["groups_per_call"]) >= 2  # a call for each rank


def launch_ranks(tiny_model_dir, out) -> faults.Launch:
    return faults.Launch(*options(tiny_model_dir, out, "5 calls", "--iterations", "1000", "--eval-every", "0"),
                         launcher=(*TORCHRUN[1:], "--standalone", "--nproc-per-node", "2"))


def rank_pid(launch: faults.Launch, rank: int) -> int:
    """The PID of trainer rank `rank` (a child of the torchrun agent, RANK in its environment)."""
    for pid in faults.children(launch.process.pid):
        if f"\0RANK={rank}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
            return pid
    raise AssertionError(f"no trainer rank {rank} among the children of {launch.process.pid}")


def all_stopped(launch: faults.Launch) -> str:
    """Assert that the run ended non-zero within 10 s of the signal, no process of it left running and nothing left
    in /dev/shm (torchrun's own report holds tracebacks: not checked, unlike faults.Launch.assert_stopped); stderr."""
    launch.finish(faults.hang_bound(faults.STOP_SECONDS))
    running, files = launch.leftovers()
    assert not running, [launch.describe(p) for p in running]
    assert not files, files
    assert launch.process.returncode != 0
    return "\n".join(launch.stderr)


@pytest.mark.slow  # process-level: torchrun
@pytest.mark.parametrize("how", ["kill rank 1", "ctrl-c"])
def test_a_dead_rank_or_ctrl_c_stops_every_process(tiny_model_dir, tmp_path, how):
    """Claim: SIGKILL of one trainer rank, or Ctrl-C (SIGINT to the launcher's process group), stops
    every process of the run (launcher, ranks, their inference processes) within 10 s, none left behind. The
    surviving rank says in one line which rank ended first (by PID, rank 0 not knowing why: it is not its parent);
    torchrun's report names the rank that died and its signal."""
    with launch_ranks(tiny_model_dir, tmp_path) as launch:
        launch.wait_for(r"^iter +2 ")
        if how == "ctrl-c":
            launch.send(signal.SIGINT, group=True)
        else:
            killed = rank_pid(launch, 1)
            launch.send(signal.SIGKILL, to=killed)
        err = all_stopped(launch)
        if how == "kill rank 1":  # found gone by a failed collective, or on torchrun's SIGTERM
            assert re.search(rf"error: trainer rank 0 of 2: (.* failed: )?trainer rank 1 of 2 \(PID {killed}\) "
                             "ended first", err), err
            assert "rank      : 1 (local_rank: 1)" in err and "Signal 9 (SIGKILL)" in err, err
        else:  # torchrun passes SIGINT on to each rank
            assert all(f"trainer rank {rank} of 2: interrupted by SIGINT" in err for rank in (0, 1)), err


@pytest.mark.slow  # process-level: torchrun
def test_ranks_launched_with_other_options_are_refused(tiny_model_dir, tmp_path):
    """Claim: two "nodes" launched with different options (here --seed) both stop at once, naming the rank and the
    option, instead of training two runs at once or waiting for each other until the timeout."""
    with two_nodes("other-options", [options(tiny_model_dir, tmp_path / str(node), "5 calls", "--seed", seed)
                                     for node, seed in ((0, "0"), (1, "7"))]) as launches:
        errors = [launch.communicate(timeout=120)[1] for launch in launches]
    assert all(launch.returncode != 0 for launch in launches)
    assert all("ranks launched with other options than rank 0: rank 1: --seed 7 (rank 0: 0)" in err
               for err in errors), errors


def test_every_rank_meets_the_collectives_in_the_same_order(tiny_model_dir, monkeypatch):
    """Claim: with --scale-rewards batch and β > 0, a rank holding none of mini-batch 0's
    groups (4 prompts in calls of 2, two mini-batches: rank 1 has only mini-batch 1's) meets the iteration's
    collectives in the order rank 0 does: the gather of the batch's rewards first, then each step's all-reduces. Each rank runs here alone, its collectives recorded (they return
    this rank's own values: their order is the claim, not their sums)."""
    import grpo
    from conftest import learn_iteration
    from infra import distributed
    from infra.models import load_model
    from infra.command_line import parse_args
    from infra.timeline import Timeline
    from launch.setup import build_tri_model
    from rollout import ScoredGroup
    calls: list[str] = []
    monkeypatch.setattr(distributed, "gather_dicts", lambda local, ranks: calls.append("gather") or dict(local))
    monkeypatch.setattr(distributed, "sum_values", lambda values, ranks, device: calls.append("sum values")
                        or [float(v) for v in values])
    monkeypatch.setattr(distributed, "max_values", lambda values, ranks, device: calls.append("max values")
                        or [float(v) for v in values])

    def sum_gradients(params, ranks):
        calls.append("sum gradients")
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return params
    monkeypatch.setattr(distributed, "sum_gradients", sum_gradients)
    cfg = parse_args(["--model", str(tiny_model_dir), "--batch-size", "16", "--group-size", "4", "--max-new-tokens",
                      "4", "--groups-per-call", "2", "--updates-per-iteration", "2", "--micro-batch-tokens", "1",
                      "--sizes", "rule", "--scale-rewards", "batch", "--beta", "0.04", "--max-grad-norm", "0"])
    rewards = [[1.0, 0.0, 0.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, 1.0], [0.25, 0.0, 1.0, 0.0]]
    groups = [ScoredGroup(0, j, 0, [50 + j, 51], [[5, 6, 0], [7, 0], [8, 9, 10, 11], [12, 0]], rewards[j],
                    grpo.group_advantages(torch.tensor(rewards[j]), 4, "batch").tolist(), call=(2 * (j // 2), 2),
                    rewards_per_function=[rewards[j]]) for j in range(4)]
    order = {}
    for rank in (0, 1):
        calls.clear()
        policy, _ = load_model(str(tiny_model_dir))
        learner = Learner(build_tri_model(cfg, policy, pad_id=1), torch.optim.SGD(policy.parameters(), lr=0.1), cfg,
                          torch.device("cpu"), Timeline(), Ranks(rank, 2), ["r"], stop_ids=[0])
        learner.tri.start_iteration()
        learner.start(0)
        learn_iteration(learner, [g for g in groups if g.index // 2 == rank])
        learner.metrics()
        order[rank] = list(calls)
    assert order[0][0] == "gather" and order[0].count("sum gradients") == 2, order[0]
    assert order[1] == order[0]


def test_a_collective_that_fails_while_a_rank_is_still_dying_names_that_rank(monkeypatch):
    """Claim: a collective that fails because a rank of this host was killed names that rank, even when the
    failure (its sockets closed by the kernel) comes before /proc shows the process ended. Stand-in: a neighbour
    that is still running when the collective fails and ends 0.3 s later; without waiting for it the line would be
    the generic one (checked)."""
    from infra import liveness
    from infra.distributed import collective
    from infra.liveness import RanksError
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    monkeypatch.setitem(liveness.NEIGHBOURS, 1, (dying.pid, "inference rank 0 of 1 (rank 1)"))
    assert liveness.gone_neighbours() == []  # still running when the collective fails
    try:
        with pytest.raises(RanksError, match=rf"receiving rollouts failed: inference rank 0 of 1 \(rank 1\) "
                                             rf"\(PID {dying.pid}\) ended first .*Connection reset by peer\)"):
            with collective("receiving rollouts", Ranks(0, 2, 0, 2)):
                raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1935: Connection reset by peer")
    finally:
        dying.wait()


WORLD_FREED = """
import gc, os, sys, weakref
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from config import Config
from infra import distributed
with distributed.process_group(Config(train_device="cpu", rollout_device="cpu"), distributed.from_environment()):
    import torch._dynamo  # noqa: F401  (engine.py's torch.compiler.disable imports it once a run has started)
    import torch.distributed.nn.functional  # noqa: F401  (what torch._dynamo imports that binds group.WORLD)
    dist.all_reduce(torch.ones(1))
    world = weakref.ref(dist.group.WORLD)
gc.collect()
threads = [open(f"/proc/self/task/{{task}}/comm").read().strip() for task in os.listdir("/proc/self/task")]
# both lines in one write (below the pipe's atomic size), so that the two ranks' reports never interleave
os.write(1, (f"world group alive after the block: {{world() is not None}}\\n"
             f"gloo threads after the block: {{sorted(name for name in threads if 'gloo' in name)}}\\n").encode())
"""


@pytest.mark.slow  # process-level: torchrun
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from Linux's /proc")
def test_the_world_group_is_freed_when_its_block_ends(tmp_path):
    """Claim: once distributed.process_group's block ends, no gloo thread of its group is left, also when torch
    modules that take `group=group.WORLD` as a default argument were first imported inside the block (as the run
    imports them); else the group outlives destroy_process_group and its threads are torn down during the
    interpreter's exit, which now and then aborts a run that succeeded (SIGABRT, "terminate called without an
    active exception"). Deterministic: the group's liveness (a weak reference) and its
    threads are checked, not the aborts."""
    script = tmp_path / "world.py"
    script.write_text(WORLD_FREED.format(root=str(ROOT)))
    done = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)], timeout=120)
    assert done.stdout.count("world group alive after the block: False") == 2, done.stdout
    assert done.stdout.count("gloo threads after the block: []") == 2, done.stdout
