"""Inference ranks (launch/remote.py, --inference-ranks K): samplers on ranks of their own, θ_k broadcast to them and their
groups sent back over torch.distributed, are the single-process run, and fail cleanly.

Tolerances: one trainer rank with one inference rank computes exactly what the single process computes (the same
calls sampled with the same seeds at the same thread count, the same groups in the same order into the same
micro-batches, θ_k broadcast bit for bit): equal bits (torch.equal), as async equals sync (tests/method/test_pipeline.py).
Two trainer ranks sum their gradients in another order: the tolerances of tests/method/test_distributed.py, derived there.
"""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import faults
import pytest
import torch
from test_distributed import (
    ROOT,
    TORCHRUN,
    all_stopped,
    assert_same_run,
    initial_weights,
    options,
    result,
    run,
    single_process,  # noqa: F401  (the fixture)
    two_nodes,
)

from infra.distributed import Ranks, split_roles
from infra.liveness import RanksError
from infra.timeline import INFERENCE, Span
from launch.remote import destination
from rollout import ScoredGroup, IterationDone
from launch import run_output


@pytest.mark.slow  # process-level: torchrun
def test_one_trainer_rank_and_one_inference_rank_are_the_single_process_bitwise(tiny_model_dir, single_process,
                                                                                tmp_path):
    """Claim: `torchrun --nproc-per-node 2 ... --inference-ranks 1` (rank 0 trains, rank 1 samples:
    θ_k crosses by a torch.distributed broadcast, the groups by point-to-point sends, nothing by shared memory) is
    bitwise the single-process run: every row, held-out rewards included, and the final weights."""
    done = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "trainer.py",
                *options(tiny_model_dir, tmp_path, "5 calls", "--inference-ranks", "1")])
    assert sum(line.startswith("iter ") for line in done.stdout.splitlines()) == 3, done.stdout
    assert "this run:" not in done.stdout  # the device-split line is an accelerator run's (run_output.device_split)
    from types import SimpleNamespace

    from infra.command_line import parse_args
    cfg = parse_args([str(arg) for arg in options(tiny_model_dir, tmp_path, "5 calls")])
    split = run_output.device_split(cfg, [(5.4, 2.0)],
                                 SimpleNamespace(inference=1, size=1))
    assert "(this run: 1 + 1)" in split  # where it is printed, it counts the inference rank as the inference side
    (single_rows, single_weights), (rows, weights) = single_process("5 calls"), result(tmp_path)
    assert torch.equal(weights, single_weights)
    keys = ("reward", "reward_std", "completions/mean_length", "eval_reward", "loss", "grad_norm", "kl",
            "clip_ratio/region_mean")
    assert [[row.get(key) for key in keys] for row in rows] == [[row.get(key) for key in keys] for row in single_rows]


@pytest.mark.slow  # process-level: torchrun
def test_two_nodes_of_which_one_only_samples_are_the_single_process(tiny_model_dir, single_process, tmp_path):
    """Claim: two torchrun launches of two ranks each, as two "nodes" meeting at one c10d rendezvous
    on localhost, with --inference-ranks 2: one node's two ranks train (calls c % 2), the other node's two ranks
    only sample (calls c % 2 of the 5 calls each, sent to the trainer rank that owns them), θ_k broadcast across
    the "nodes": the single process's rollouts exactly, its update within float summation order."""
    with two_nodes("inference-node", [options(tiny_model_dir, tmp_path, "5 calls", "--inference-ranks", "2")] * 2,
                   nproc_per_node=2) as launches:
        outs = [launch.communicate(timeout=300) for launch in launches]
    assert all(launch.returncode == 0 for launch in launches), [err[-3000:] for _, err in outs]
    assert sum(out.count("\niter ") + out.startswith("iter ") for out, _ in outs) == 3  # rank 0 alone logs
    assert_same_run(single_process("5 calls"), result(tmp_path), initial_weights(tiny_model_dir))


@pytest.mark.slow  # process-level: torchrun
def test_a_failing_reward_on_an_inference_rank_is_one_line_on_the_trainer(tiny_model_dir, tmp_path):
    """Claim: an inference rank whose reward raises sends the error to every trainer rank before it exits; the
    trainer rank says which inference rank failed and why in one line, and the run ends non-zero."""
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "trainer.py",
                           *options(tiny_model_dir, tmp_path, "5 calls", "--inference-ranks", "1", "--reward",
                                    "tests/rewards.py:raising_reward")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "error: trainer rank 0 of 1: inference rank 0 of 1 (rank 1) failed: RewardError" in done.stderr, \
        done.stderr[-3000:]


@pytest.mark.slow  # process-level: torchrun
@pytest.mark.parametrize("how", ["kill the inference rank", "ctrl-c"])
def test_a_dead_inference_rank_or_ctrl_c_stops_every_process(tiny_model_dir, tmp_path, how):
    """Claim: SIGKILL of an inference rank, or Ctrl-C on the launcher, stops every process of the run
    within 10 s, none left behind; the trainer rank names the inference rank that ended first, and after Ctrl-C
    each rank says it was interrupted (no rank waits for a broadcast that will not come)."""
    with faults.Launch(*options(tiny_model_dir, tmp_path, "5 calls", "--iterations", "1000", "--eval-every", "0",
                                "--inference-ranks", "1"),
                       launcher=(*TORCHRUN[1:], "--standalone", "--nproc-per-node", "2")) as launch:
        launch.wait_for(r"^iter +2 ")
        if how == "ctrl-c":
            launch.send(signal.SIGINT, group=True)
        else:
            killed = next(pid for pid in faults.children(launch.process.pid)
                          if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes())
            launch.send(signal.SIGKILL, to=killed)
        err = all_stopped(launch)
        if how == "ctrl-c":
            assert "trainer rank 0 of 1: interrupted by SIGINT" in err, err
            assert "inference rank 0 of 1 (rank 1): interrupted by SIGINT" in err, err
        else:
            assert f"inference rank 0 of 1 (rank 1) (PID {killed}) ended first" in err, err


def test_roles_routing_and_refusals(tiny_model_dir, capsys):
    """Claim: K inference ranks are the last K of torchrun's ranks; a group goes to the trainer rank that owns its
    call, IterationDone to every trainer rank, spans to rank 0; K that leaves no trainer, sync mode or several
    inference workers per rank are refused in one line."""
    from infra.command_line import parse_args
    ranks = split_roles(Ranks(5, 6, 1, 2), 4)
    assert (ranks.size, ranks.inference, ranks.is_inference, ranks.name()) == (2, 4, True, "inference rank 3 of 4 (rank 5)")
    assert split_roles(Ranks(1, 6, 1, 2), 4).name() == "trainer rank 1 of 2"
    group = ScoredGroup(0, 6, 0, [1], [[2]], [1.0], [0.0], call=(6, 2))  # call 3 of calls of 2 prompts: owner 3 % 2
    assert destination(group, ranks, 2) == [1]
    assert destination(IterationDone(0), ranks, 2) == [0, 1]
    assert destination(Span("generate", INFERENCE, 0.0, 1.0), ranks, 2) == [0]
    with pytest.raises(RanksError, match=r"--inference-ranks 2 leaves no trainer rank among the 2 rank\(s\)"):
        split_roles(Ranks(0, 2), 2)
    for extra in (["--mode", "sync"], ["--inference-workers", "2"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", str(tiny_model_dir), "--inference-ranks", "1", *extra])
        err = capsys.readouterr().err
        assert "error: --inference-ranks samples on ranks of their own" in err and err.count("\n") == 1, err
