"""Trainer ranks on torch.distributed: the process group, which rank trains which group, what crosses ranks.

    torchrun --nproc-per-node M trainer.py ...        (two nodes: --nnodes 2 --node-rank 0|1 --rdzv-backend c10d
                                                       --rdzv-endpoint HOST:PORT on each; docs/distributed.md)

Ownership. Iteration k's prompts are sampled in generate calls of C prompts (call c = prompt index // C).
Rank r of M owns the calls c with c % M == r: its own inference process samples exactly those (call
slice (r, M), rollout.rollout_iteration) and its Learner trains exactly their groups.

The step. Each rank accumulates the partial sums of its own groups; at each mini-batch's step, on every rank,

    ∇ = Σ_r Σ_{g of rank r} ∇S_g(θ_k)        D = Σ_r D_r        (all_reduce, SUM: `sum_gradients`, `sum_values`)
    θ ← AdamW(θ, clip(∇ / D))                  (clip with the norm of the summed ∇)

which is the single-process step (1/D) Σ_g ∇S_g(θ_k) (learner.Learner) with the terms summed in
another order: equal up to float rounding (tests/method/test_distributed.py derives the tolerance). An
all-reduce leaves the same bits on every rank, and every rank runs the same clip and AdamW from the same
state, so θ stays bitwise identical on all ranks: each rank publishes θ_{k+1} to its own inference
process through the shared-memory buffer (weights.py) and no weights cross ranks or nodes.

Inference ranks (--inference-ranks K): the last K ranks sample instead (launch/remote.py); the M = W - K trainer ranks
are the ranks above, with their collectives on a group of their own (GROUPS["trainers"]).

Departures, on purpose:
1. A plain all_reduce of the gradients, once per optimizer step (in buckets of BUCKET_ELEMENTS), not
   DDP: a rank trains as many micro-batches as its groups need, zero when none of its calls falls in a
   mini-batch, while DDP reduces inside every backward and would need no_sync() and join() for unequal
   counts. The cost is DDP's overlap of the reduction with the backward.
2. Rank 0 alone writes --out (metrics, policy, trace, checkpoints) and prints the log; the other ranks
   never lock or write there. Rank 0's checkpoint is every rank's: all hold the same θ and AdamW state
   (the same summed gradients, the same steps); a resumed run restores it on every rank, so --resume
   must name a path every node can read. A save must end within --collective-timeout (the others wait
   in the next step's all-reduce meanwhile).
3. `--sizes probe` on CPU: trainer rank 0 alone probes, on its share of its host's cores (cores // local ranks)
   while the others wait, and sends the sizes to every rank (`share_sizes`), at least one generate call per
   sampler; so every rank uses the same sizes, measured for one rank, not for M trainers sharing the host.
   With inference ranks the sizes must be given (or --sizes rule): the probe models a local inference process.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from config import SIZE_FIELDS
from infra import liveness
from infra.liveness import RanksError
from infra.options import fits_memory
from infra.processes import killed_with_parent

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # by the training device's kind
BUCKET_ELEMENTS = 25 * 2**20  # gradient elements per all_reduce (100 MiB of float32; DDP's default is 25 MiB)
# Options that may differ between ranks (each rank's own devices, threads and outputs); all others must agree
PER_RANK = {"device", "rollout_device", "train_device", "rollout_threads", "train_threads",
            "train_threads_after_sampling", "cache_dir", "out", "overwrite", "trace", "save", "save_every",
            "keep_checkpoints", "save_on_stop", "resume", "config"}


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks (torchrun's environment); one rank when not launched by it. The first
    `size` ranks train (trainer ranks 0..M-1); the `inference` ranks after them sample (launch/remote.py,
    --inference-ranks)."""
    rank: int = 0
    size: int = 1  # M, the trainer ranks
    local_rank: int = 0
    local_size: int = 1
    inference: int = 0  # K, the inference ranks (global ranks M..M+K-1)

    @property
    def world(self) -> int:
        return self.size + self.inference

    @property
    def is_inference(self) -> bool:
        return self.rank >= self.size

    def name(self, rank: int | None = None) -> str:
        """'trainer rank r of M' or 'inference rank j of K (rank r)', of this process or of `rank`."""
        rank = self.rank if rank is None else rank
        if rank < self.size:
            return f"trainer rank {rank} of {self.size}"
        return f"inference rank {rank - self.size} of {self.inference} (rank {rank})"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes --out."""
        return self.rank == 0

    @property
    def call_slice(self) -> tuple[int, int]:
        """(r, M): the generate calls c % M == r are this rank's (rollout.rollout_iteration's `call_slice`)."""
        return self.rank, self.size


def from_environment(environ=os.environ) -> Ranks:
    """The ranks torchrun describes in RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (Ranks() without them)."""
    if "WORLD_SIZE" not in environ:
        return Ranks()
    return Ranks(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)),
                 int(environ.get("LOCAL_WORLD_SIZE", 1)))


def die_with_launcher(launcher: int, environ=os.environ) -> None:
    """Under torchrun, end this rank when torchrun ends, however it ends (SIGKILL included): torchrun starts each rank
    in a session of its own, out of reach of the signals to its own group, and a rank left behind trains on and
    writes --out. As for the inference processes (processes.die_with_parent): the kernel sends SIGKILL when the
    parent thread exits (prctl PR_SET_PDEATHSIG; torchrun's elastic agent starts the ranks from its main thread),
    and a launcher that died before the prctl is caught by comparing the parent PID with `launcher`, the one read
    at start-up. The rank's inference processes then die with it, by their own parent-death signal."""
    if "TORCHELASTIC_RUN_ID" in environ:  # a rank of torchrun's elastic agent
        killed_with_parent(launcher)


def split_roles(ranks: Ranks, inference: int) -> Ranks:
    """torchrun's W ranks as W - K trainer ranks and K inference ranks (--inference-ranks K)."""
    if inference == 0:
        return ranks
    if inference >= ranks.size:
        raise RanksError(f"--inference-ranks {inference} leaves no trainer rank among the {ranks.size} rank(s) of this "
                         f"launch: inference ranks are torchrun ranks of their own, so launch with torchrun and more "
                         f"ranks (--nproc-per-node, --nnodes) than --inference-ranks")
    return dataclasses.replace(ranks, size=ranks.size - inference, inference=inference)


def owner(call: int, ranks: int) -> int:
    """The rank that samples and trains generate call `call` (prompts call·C to call·C + C - 1)."""
    return call % ranks


def place(cfg, ranks: Ranks, given: set[str]):
    """`cfg` for this rank: its devices (local rank l of L with N inference workers, on an accelerator: trains on
    :l; its workers sample on :L+l·N+w when the node has L·(1+N) devices, else all on :L+l when it has 2L, else on
    :l too; sync mode on :l), the generate calls (when --groups-per-call is not given, at most P // (M·N) prompts
    per call, so that every rank's every worker has a call: the rule's one call per iteration would leave all
    ranks but rank 0 idle), and, off rank 0, no output (no policy, no trace, no checkpoint).
    Devices named by --train-device / --rollout-device, or --device with an index, are kept."""
    if ranks.world == 1:
        return cfg
    if "groups_per_call" not in given and cfg.groups_per_call:
        cfg = dataclasses.replace(cfg, groups_per_call=min(cfg.groups_per_call,
                                                            max(1, cfg.prompts_per_iteration // samplers(cfg, ranks))))
    kind = cfg.train_device.split(":")[0]
    if kind != "cpu" and ":" not in cfg.device and ranks.inference:  # one device per rank, of either kind
        own = f"{kind}:{ranks.local_rank}"
        cfg = dataclasses.replace(cfg, train_device=cfg.train_device if "train_device" in given else own,
                                  rollout_device=cfg.rollout_device if "rollout_device" in given else own)
    elif kind != "cpu" and ":" not in cfg.device:
        count, local, workers = getattr(torch, kind).device_count(), ranks.local_size, cfg.inference_workers
        train = f"{kind}:{ranks.local_rank}"
        if count >= local * (1 + workers):  # a device per worker
            rollout = ",".join(f"{kind}:{local + ranks.local_rank * workers + w}" for w in range(workers))
        else:
            rollout = f"{kind}:{local + ranks.local_rank}" if count >= 2 * local else train
        rollout = train if cfg.mode == "sync" else rollout  # sync samples in the trainer's process
        cfg = dataclasses.replace(cfg, train_device=cfg.train_device if "train_device" in given else train,
                                  rollout_device=cfg.rollout_device if "rollout_device" in given else rollout)
    if not ranks.is_main:
        cfg = dataclasses.replace(cfg, save=False, trace=None, save_every=0, save_on_stop=False)
    return cfg


def samplers(cfg, ranks: Ranks) -> int:
    """The processes that sample an iteration's generate calls, each needing one: the inference ranks, or every
    trainer rank's inference workers (with inference ranks, each trainer rank owns calls too)."""
    return max(ranks.inference, ranks.size) if ranks.inference else ranks.size * cfg.inference_workers


def check(cfg, ranks: Ranks) -> None:
    """Refuse, in one line, what ranks do not support (departure 3); the generate calls once they are known."""
    if ranks.world == 1:
        return
    if not cfg.sized and ranks.inference and not fits_memory(cfg):  # (fitting the micro-batch needs no probe)
        raise RanksError(f"--sizes probe does not work with inference ranks ({ranks.inference}): the probe times a "
                         "local inference process; give --groups-per-call, --micro-batch-tokens, --rollout-threads "
                         "and --train-threads, or pass --sizes rule")
    if cfg.groups_per_call is None:  # probed by rank 0 (`share_sizes`), then checked again
        return
    needed = samplers(cfg, ranks)
    if cfg.calls_per_iteration < needed:
        who = (f"{ranks.size} trainer ranks and {ranks.inference} inference ranks (each needs calls)" if ranks.inference
               else f"{ranks.size} ranks x {cfg.inference_workers} inference workers that sample them")
        raise RanksError(f"--groups-per-call {cfg.groups_per_call} makes {cfg.calls_per_iteration} generate calls "
                         f"per iteration, fewer than the {who} (some would sit idle): give --groups-per-call "
                         f"{max(1, cfg.prompts_per_iteration // needed)} or less")


def share_sizes(cfg, ranks: Ranks, chosen=None):
    """`cfg` with trainer rank 0's sizes (`chosen`, given on rank 0 only: what launch/sizing.py chose there) where
    they are open, on every trainer rank (broadcast_object_list on the world group; no inference ranks: departure
    3). The generate calls and the micro-batch are rank 0's on every rank (the calls decide who samples what);
    a rank keeps the threads it was given."""
    sizes = [{name: getattr(chosen, name) for name in SIZE_FIELDS} if ranks.is_main else None]
    with collective("the broadcast of trainer rank 0's sizes", ranks):
        dist.broadcast_object_list(sizes, src=0)
    shared = sizes[0]
    mine = {name: getattr(cfg, name) for name in SIZE_FIELDS if "threads" in name and getattr(cfg, name) is not None}
    return dataclasses.replace(cfg, **{**shared, **mine})


GROUPS: dict = {}  # with inference ranks (process_group): "trainers", "weights", "transport" (one per trainer rank)


@contextmanager
def process_group(cfg, ranks: Ranks) -> Iterator[None]:
    """The ranks' process group for the block (nothing when there is one rank), destroyed however it ends.
    Every collective, the first rendezvous included, gives up after --collective-timeout seconds. With inference
    ranks, the world group is gloo (the ranks' device kinds are compared on it first: a mix would never meet) and
    the subgroups (GROUPS) are: the trainer ranks' (gradients) and trainer rank 0 with the inference ranks (θ's
    broadcast), both on the devices' backend; rank 0 with the inference ranks on gloo ("commands": a CPU tensor,
    so that a waiting rank takes signals on every backend); for each trainer rank r, r with the inference ranks on
    gloo (the groups sent to r as Python objects: launch/remote.py; one group per destination, so that no send waits
    behind another's)."""
    if ranks.world == 1:
        yield
        return
    device = cfg.rollout_device if ranks.is_inference else cfg.train_device
    kind = device.split(":")[0]
    if kind != "cpu":
        getattr(torch, kind).set_device(device)
    timeout = timedelta(seconds=cfg.collective_timeout)
    bind_world_defaults_first()
    dist.init_process_group("gloo" if ranks.inference else BACKENDS[kind], timeout=timeout)
    try:
        check_same_options(cfg, ranks)
        note_neighbours(ranks)
        if ranks.inference:  # every rank creates every group, in the same order (torch.distributed's rule)
            check_same_device_kind(kind, ranks)
            inference = list(range(ranks.size, ranks.world))
            with collective("the creation of the ranks' groups", ranks):
                GROUPS["trainers"] = dist.new_group(list(range(ranks.size)), timeout, BACKENDS[kind])
                GROUPS["weights"] = dist.new_group([0, *inference], timeout, BACKENDS[kind])
                GROUPS["commands"] = dist.new_group([0, *inference], timeout, "gloo")
                GROUPS["transport"] = [dist.new_group([r, *inference], timeout, "gloo") for r in range(ranks.size)]
        yield
    finally:
        GROUPS.clear()
        dist.destroy_process_group()


def bind_world_defaults_first() -> None:
    """Import, before the process group exists, the torch modules whose functions take `group=group.WORLD` as a
    default argument (torch.distributed.nn.functional: torch._dynamo imports it, and engine.py imports torch._dynamo
    once the run has started): imported later, each default would hold the world group past destroy_process_group,
    its gloo threads would still run when the interpreter exits, and their teardown then aborts the rank now and
    then ("terminate called without an active exception", SIGABRT) after a run that succeeded."""
    import torch.distributed.nn.functional  # noqa: F401


def check_same_device_kind(kind: str, ranks: Ranks) -> None:
    """Refuse, on every rank, ranks whose devices are of other kinds (cuda trainers, cpu samplers): the broadcast of
    θ between them has no common backend."""
    everyone: list[str | None] = [None] * ranks.world
    with collective("the comparison of the ranks' devices", ranks):
        dist.all_gather_object(everyone, kind)
    if len(set(everyone)) > 1:
        raise RanksError("the ranks' devices are of different kinds (" + ", ".join(
            f"{ranks.name(rank)}: {k}" for rank, k in enumerate(everyone)) + "): θ's broadcast needs one kind for all "
            "(give --device, --train-device or --rollout-device so that they agree)")


def check_same_options(cfg, ranks: Ranks) -> None:
    """Refuse, on every rank, ranks launched with other options than rank 0's (two nodes, two commands): they would
    sample and train another run, or wait for each other until the timeout. Devices, threads, outputs may differ."""
    mine = {key: value for key, value in dataclasses.asdict(cfg).items() if key not in PER_RANK}
    everyone: list[dict | None] = [None] * ranks.world
    with collective("the comparison of the ranks' options", ranks):
        dist.all_gather_object(everyone, mine)
    first = everyone[0]
    differ = {rank: [key for key in first if theirs.get(key) != first[key]] for rank, theirs in enumerate(everyone)}
    if any(differ.values()):
        raise RanksError("ranks launched with other options than rank 0: " + "; ".join(
            f"rank {rank}: " + ", ".join(f"--{key.replace('_', '-')} {everyone[rank].get(key)} (rank 0: {first[key]})"
                                         for key in keys) for rank, keys in differ.items() if keys))


def note_neighbours(ranks: Ranks) -> None:
    """Remember the PIDs of the other ranks on this host, so that a rank stopped by torchrun can say which of them
    is gone (`liveness.gone_neighbours`)."""
    everyone: list[tuple | None] = [None] * ranks.world
    with collective("the exchange of the ranks' hosts", ranks):
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
    liveness.NEIGHBOURS.clear()
    liveness.NEIGHBOURS.update({rank: (pid, ranks.name(rank)) for rank, (host, pid) in enumerate(everyone)
                                if host == socket.gethostname() and rank != ranks.rank})


@contextmanager
def collective(what: str, ranks: Ranks) -> Iterator[None]:
    """A collective's failure (a peer died, or did not join within the timeout) as one line naming this rank."""
    try:
        yield
    except RanksError:
        raise  # named already (liveness.check_neighbours)
    except (RuntimeError, dist.DistError) as error:  # gloo raises RuntimeError, NCCL/HCCL DistBackendError
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        gone = liveness.gone_neighbours_settled()  # a rank on this host that has ended (or is ending): name it
        who = liveness.ended_first(gone) if gone else "another rank died or did not join within --collective-timeout"
        raise RanksError(f"{what} failed: {who} ({first_line}); torchrun's report names the rank") from None


def sum_gradients(params: list[torch.nn.Parameter], ranks: Ranks) -> list[torch.nn.Parameter]:
    """p.grad := Σ_r p.grad on every rank, in place, in buckets of flattened gradients; returns the parameters
    that have a gradient on some rank (what the single process would clip and step). A rank that trained none
    of the mini-batch's groups has no gradients: zeros there. One all_reduce per bucket, and one for which exist."""
    device = params[0].device
    exists = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)  # (n,)
    with collective("the gradient all-reduce", ranks):
        dist.all_reduce(exists, group=GROUPS.get("trainers"))
        params = [p for p, count in zip(params, exists.tolist()) if count > 0]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        for i, p in enumerate(params):
            bucket.append(p.grad)
            if i == len(params) - 1 or sum(g.numel() for g in bucket) + params[i + 1].numel() > BUCKET_ELEMENTS:
                flat = torch.cat([g.reshape(-1) for g in bucket])  # (Σ numel,)
                dist.all_reduce(flat, group=GROUPS.get("trainers"))
                for g, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(summed.view_as(g))
                bucket = []
    return params


def sum_values(values: list[float | torch.Tensor], ranks: Ranks, device: torch.device) -> list[float]:
    """Σ_r of each value (counts, partial sums of the loss and statistics), in float64: integer counts stay exact."""
    return _all_reduce(values, ranks, device, dist.ReduceOp.SUM, "the all-reduce of the step's counts")


def max_values(values: list[float | torch.Tensor], ranks: Ranks, device: torch.device) -> list[float]:
    """max_r of each value (pass -x for a minimum)."""
    return _all_reduce(values, ranks, device, dist.ReduceOp.MAX, "the all-reduce of the iteration's extremes")


def _all_reduce(values: list[float | torch.Tensor], ranks: Ranks, device: torch.device, op, what: str) -> list[float]:
    flat = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])  # (n,)
    with collective(what, ranks):
        dist.all_reduce(flat, op=op, group=GROUPS.get("trainers"))
    return flat.tolist()


def gather_dicts(local: dict, ranks: Ranks) -> dict:
    """The union of every rank's dict (keys are disjoint: e.g. group index -> rewards)."""
    everyone: list[dict | None] = [None] * ranks.size
    with collective("the gather of the rewards", ranks):
        dist.all_gather_object(everyone, local, group=GROUPS.get("trainers"))
    return {key: value for part in everyone for key, value in part.items()}


def check_same_weights(policy: torch.nn.Module, ranks: Ranks) -> None:
    """Raise unless every rank holds the same θ, as the step promises (each rank publishes its own copy to its
    inference process: a rank that drifted would sample other rollouts). Compares a float64 checksum per
    parameter (its sum and its sum of squares): equal bits give equal checksums."""
    checksums = [(p.detach().double().sum().item(), p.detach().double().square().sum().item())
                 for p in policy.parameters()]
    everyone: list[list | None] = [None] * ranks.size
    with collective("the check that every rank holds the same weights", ranks):
        dist.all_gather_object(everyone, checksums, group=GROUPS.get("trainers"))
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise RanksError(f"trainer ranks {differ} hold other weights than rank 0 after the same steps: the "
                         "gradient all-reduce did not leave the same bits on every rank")
