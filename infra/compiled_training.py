"""The training side's decoder layers through torch.compile, forward and backward (--compile-train): the tri-model's
scorer with every decoder layer of the copy it scores compiled, as infra/compiled_step.py compiles the engine's for
decode:

    tri = TriModel(policy, compiled_scorer(packing.logprobs_fn(policy, ..., dense_mask=True)), ...)

1. Regional compilation (`compiled_step.compiled_layers`): every layer of the policy, the old policy and the
   reference runs one compilation of its class's forward. The layers differ only in their parameters, which the
   compiled code takes as inputs, so a 24-layer model and its frozen copies share one layer's code. AOTAutograd
   compiles the layer's backward with it: inductor fuses the elementwise chains (RMSNorm, rotary, SiLU·up, residual
   adds) around the matrix products both ways. The embedding, rotary tables, mask, final norm and the LM head
   (attention.HeadLogprobs, a hand-written autograd Function that never holds full logits) stay eager.
2. Shapes: the rows and the row length are symbolic (torch.compile's dynamic=True), the model's own sizes static
   (parameters keep static shapes), so one compilation serves every micro-batch whatever its lengths: one for the
   policy (training mode, with gradients) and one for the frozen copies (eval mode, without), and one more of each
   for a micro-batch of a single row, which Dynamo specialises; LoRA's adapter switched off for the reference adds
   its own. At most compiled_step.RECOMPILE_LIMIT in all: Dynamo counts per function, so where the engine compiles
   the same layer forward in this process (sync mode on a GPU) its compilations count too. The rows stay padded as
   --pad-to-multiple-of says (128 on GPUs), so attention kernels that are planned per shape (cuDNN's) see few shapes.
3. Packed rows take attention.py's dense mask, not packing.py's structured kernel: that kernel's Python loop over
   rows would make each row's lengths constants of the compiled code (a compilation per micro-batch). On
   accelerators the dense mask is the packed path anyway (packing.py, departure 5).
4. Compiled kernels sum in another order than eager ones: log-probs, loss and gradients equal the eager ones up to
   float rounding (tests/method/test_compiled_training.py derives the bound), never more.
5. Failures cost speed, never the run: a forward that cannot compile (no C++ compiler, no Triton, past the limit)
   says so in one line and the training side scores eagerly from then on; the failed micro-batch is scored again,
   eagerly, before any backward ran, so nothing is counted twice. With symbolic shapes AOTAutograd compiles the
   backward with its forward; a backward that fails to compile later raises.
6. Not with activation checkpointing: its recomputation in backward runs the layers' eager forward, whose saved
   tensors are not the compiled forward's (config validation refuses the pair).
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from infra import compiled_step

FAILED: str | None = None  # why compiling the training side failed in this process, once it has


def compiled_scorer(logprobs_fn: Callable[..., tuple], dynamic: bool = True) -> Callable[..., tuple]:
    """tri_model.TriModel's `logprobs_fn` (model, groups, **options) -> log-probs, with the decoder layers of the
    model it scores compiled (departure 2; `dynamic=False` specialises on every shape: for a fixed-shape
    measurement), eager once compiling has failed in this process (departure 5)."""
    def logprobs(model: torch.nn.Module, groups, **options) -> tuple:
        if FAILED is None:
            try:
                with compiled_step.compiled_layers(model.get_decoder(), dynamic):
                    return logprobs_fn(model, groups, **options)
            except compiled_step.compile_errors() as error:
                failed(error)
        return logprobs_fn(model, groups, **options)
    return logprobs


def failed(error: Exception) -> None:
    """Compiling failed: one line on stderr, and the training side runs eagerly from then on."""
    global FAILED
    FAILED = compiled_step.failure_line(error)
    print(f"periodic-rl: torch.compile failed, training without it: {FAILED}", file=sys.stderr, flush=True)


def compilations() -> int:
    """Graphs Dynamo has compiled in this process so far (every compiled function's; a difference counts one's)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]
