"""θ_k from the trainer to the inference process: one flat tensor in shared memory and a version counter.

    trainer:            publish(θ_k)   copy every parameter into its slice of the flat tensor, then
                                       version := k (-1 while writing)
    inference process:  attach(model)  on CPU, make the model's parameters views of their slices: loading
                                       θ_k is then free; on a GPU/NPU, load_into copies the buffer once
                        version()      read before and after sampling: a group is tagged with the weights
                                       that sampled it (rollout.rollout_iteration)

Nothing is pickled per iteration: the buffer's file descriptor crosses to the inference process once.
Only what training changes is published (`published`): every parameter, or with a LoRA adapter (--use-peft) the
adapter alone, a fraction of a percent of θ; the inference side loads the base once, at start, with its adapter.
A too-small /dev/shm (Docker's default is 64 MB) fails before anything is allocated, in one line.

Departure, on purpose: the buffer lives in CPU shared memory even for GPU runs (one device-to-host copy
per publish, one host-to-device copy per load); CUDA IPC would save a copy but ties both processes to one
driver context and does not cover NPUs.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil

import torch

from infra.errors import UserError


class SharedMemoryError(UserError):
    """/dev/shm cannot hold the weight buffer; the message names the fix."""


class OffPolicyError(UserError):
    """A group sampled by weights other than the current iteration's: on-policy would be broken."""


SHM_SLACK_BYTES = 8 * 2**20  # room to spare in /dev/shm beside the buffer (the heartbeat, other programs)


def check_shared_memory(nbytes: int, path: str = "/dev/shm") -> None:
    """Fail in one line, naming the fix, when `path` cannot hold `nbytes` (Docker's default is 64 MB)."""
    if not os.path.isdir(path):  # not Linux: shared memory is not a size-limited file system there
        return
    free = shutil.disk_usage(path).free
    if nbytes + SHM_SLACK_BYTES > free:
        need_gib = math.ceil((1.25 * nbytes + SHM_SLACK_BYTES) / 2**30)  # with room to spare
        raise SharedMemoryError(f"the shared-memory weight buffer needs {nbytes / 2**20:,.0f} MiB "
                                f"(+{SHM_SLACK_BYTES // 2**20} MiB to spare) but {path} has {free / 2**20:,.0f} MiB "
                                f"free: give the container more (docker run --shm-size={need_gib}g, or Kubernetes: an "
                                f"emptyDir with medium Memory on /dev/shm), free some, or use --mode sync")


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.share_memory_()`, in one line when /dev/shm is full (filled since `check_shared_memory`), and without
    the file torch leaves there then (it names the file in its error)."""
    try:
        return tensor.share_memory_()
    except RuntimeError as error:
        leftover = re.search(r"<(/torch_[\w.-]+)>", str(error))
        if leftover is None:
            raise
        with contextlib.suppress(OSError):
            os.unlink("/dev/shm" + leftover[1])
        raise SharedMemoryError(f"could not allocate {tensor.nbytes / 2**20:,.1f} MiB of shared memory ({error}): free "
                            "some in /dev/shm, give the container more (docker run --shm-size), or use --mode sync"
                            ) from None


def published(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters training changes, so the ones each iteration publishes: those that require gradients, i.e.
    all of them, or a LoRA adapter's (peft freezes the base). Both sides hold the same model, so the same list."""
    return [p for p in model.parameters() if p.requires_grad]  # tied weights (embeddings = lm_head) appear once


def views_of(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive slices of `flat`, one per shape, shaped as it: the parameters' places in a flat θ."""
    out, start = [], 0
    for shape in shapes:
        out.append(flat[start:start + shape.numel()].view(shape))
        start += shape.numel()
    return out


class WeightBuffer:
    """θ as one flat tensor in shared memory plus a version counter (θ: the `published` parameters).

    publish(model, k): copy every parameter into its slice (casting to the buffer's dtype), then set version = k.
    attach(model):     on CPU, make the model's parameters views of their slices (zero copy).
    load_into(model):  check the version; copy only where attach could not alias (GPU, NPU).

    `dtype` is what the inference side computes in: bf16 halves the bytes published per iteration while
    the trainer keeps float32 masters.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None):
        params = published(model)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"WeightBuffer needs one parameter dtype, got {dtypes}")
        dtype = dtype or params[0].dtype
        self.shapes = [p.shape for p in params]
        numel = sum(p.numel() for p in params)
        check_shared_memory(numel * dtype.itemsize)
        self.flat = shared(torch.empty(numel, dtype=dtype))  # (num_params,)
        self._version = shared(torch.full((1,), -1, dtype=torch.int64))  # (1,) shared too
        self.aliased = False

    def views(self) -> list[torch.Tensor]:
        return views_of(self.flat, self.shapes)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        self._version.fill_(-1)  # being written: a sampler that reads the version now tags its groups -1
        for view, param in zip(self.views(), published(model), strict=True):
            view.copy_(param)
        self._version.fill_(version)

    def version(self) -> int:
        return int(self._version[0])

    def attach(self, model: torch.nn.Module) -> None:
        params = published(model)
        if [p.shape for p in params] != self.shapes:
            raise ValueError("the inference model's parameters do not match the trainer's (same --model?)")
        if all(p.device.type == "cpu" and p.dtype == self.flat.dtype for p in params):
            for view, param in zip(self.views(), params):
                param.data = view
            self.aliased = True

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, expected_version: int) -> None:
        if self.version() != expected_version:
            raise OffPolicyError(f"weight buffer holds version {self.version()}, expected {expected_version}")
        if not self.aliased:
            for param, view in zip(published(model), self.views()):
                param.copy_(view, non_blocking=True)
