"""The engine's decode step on a GPU: its decoder layers and draw through torch.compile, the whole step captured as
CUDA graphs and replayed. The same step as engine.GenerateCall.decode, reading and writing the same tensors:

    responses = engine.sample_groups(model, prompts, G, max_new_tokens=M, decode_step=compiled_step.decode_step)

1. torch.compile (`compiled_layers`): every decoder layer runs one compilation of its class's forward (regional
   compilation): the layers differ only in their parameters, which the compiled code takes as inputs, and the
   layer index is an input too (allow_unspec_int_on_nn_module), so a 24-layer model compiles one layer's code,
   once per process. Inductor fuses each layer's elementwise chains (RMSNorm, rotary, SiLU·up, residual adds)
   around the matrix products; the draw's passes over the (n, V) logits are fused the same way. The cache writes
   (engine.RowCache.update), the mask and the rows' bookkeeping stay eager.
2. CUDA graphs (`DecodeGraphs`): the step captured once per row count (the powers of two of fixed shapes) and
   replayed: one launch per step instead of hundreds. Graphs read the parameters where they are, so weights
   copied into them in place (param.copy_, a publish) need no recapture.
3. Failures cost speed, never the run: torch.compile that cannot compile (no C++ compiler, no Triton, past
   RECOMPILE_LIMIT compilations) says so in one line and the process decodes eagerly; a capture that fails says
   so in one line and the call goes on without graphs. Imports nothing of the project: copy it beside engine.py.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Callable

import torch

_COMPILED: dict[tuple, Callable] = {}  # (a function, dynamic) -> its torch.compile, made once per process
COMPILE_FAILED: str | None = None  # why torch.compile failed in this process (compile_failed), once it has
RECOMPILE_LIMIT = 32  # compilations of one compiled function before compile_failed (compile_settings)


def decode_step(call, compiled: bool = True, graphs: bool | None = None) -> Callable[[int], None]:
    """engine.sample_groups's `decode_step`: the call's step n -> None, its layers and draw through torch.compile
    if `compiled`, captured as CUDA graphs if `graphs` (default: on CUDA)."""
    if compiled:
        call.decode_layers = compiled_forward(call.decoder)
        call.decode_draw = compiled_function(call.decode_draw)
    graphs = call.device.type == "cuda" if graphs is None else graphs
    return DecodeGraphs(call).decode if graphs else call.decode


# --- torch.compile ---
def failure_line(error: Exception) -> str:
    """What a torch.compile failure was, in one line: the backend's own error, not Dynamo's wrapper."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    return f"{type(cause).__name__}: {(str(cause).strip() or '?').splitlines()[0]}"[:300]


def compile_failed(error: Exception) -> None:
    """torch.compile failed: one line on stderr, and the process decodes without it from then on."""
    global COMPILE_FAILED
    COMPILE_FAILED = failure_line(error)
    print(f"engine: torch.compile failed, decoding without it: {COMPILE_FAILED}", file=sys.stderr, flush=True)


def compile_errors() -> tuple[type, ...]:
    """What torch.compile raises when it cannot compile a step (or compile it once more: compile_settings)."""
    from torch._dynamo import exc
    return exc.TorchDynamoException, exc.FailOnRecompileLimitHit


def compile_settings():
    """Dynamo's settings for the engine's compiled code: the layer index stays an input, not a constant (one
    compilation for all layers); up to RECOMPILE_LIMIT compilations of each function (row counts, cache lengths,
    thread counts, sampling settings may each add one), and past it an exception, where Dynamo would quietly run
    that code eagerly from then on."""
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=RECOMPILE_LIMIT,
                                      fail_on_recompile_limit_hit=True)


def compiled(function: Callable, dynamic: bool | None = None) -> Callable:
    """torch.compile of `function`, made once per process (`dynamic`: torch.compile's; None, shapes made symbolic
    once they change)."""
    if (function, dynamic) not in _COMPILED:
        _COMPILED[function, dynamic] = torch.compile(function, dynamic=dynamic)
    return _COMPILED[function, dynamic]


@contextlib.contextmanager
def compiled_layers(decoder, dynamic: bool | None = None):
    """Inside, every layer of `decoder` runs one torch.compile of its class's forward (`dynamic` as `compiled`); on
    the way out the layers run their own forward again (a forward set on a layer itself, a hook, is kept)."""
    layers = list(decoder.layers)
    forward = compiled(type(layers[0]).forward, dynamic)
    own = [vars(layer).get("forward") for layer in layers]
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    try:
        with compile_settings():
            yield
    finally:
        for layer, kept in zip(layers, own):
            if kept is None:
                del layer.forward
            else:
                layer.forward = kept


def compiled_forward(decoder) -> Callable[[dict], torch.Tensor]:
    """inputs -> the decoder's last hidden states through compiled_layers, eager once compiling has failed in this
    process. Running a failed step again eagerly is exact: its cache writes put the same keys at the same slots."""
    def forward(inputs: dict) -> torch.Tensor:
        if COMPILE_FAILED is None:
            try:
                with compiled_layers(decoder):
                    return decoder(**inputs).last_hidden_state
            except compile_errors() as error:
                compile_failed(error)
        return decoder(**inputs).last_hidden_state
    return forward


def compiled_function(function: Callable) -> Callable:
    """`function` through torch.compile (engine.checked_draw: its passes over the logits fused), eager once
    compiling has failed in this process."""
    def run(*args):
        if COMPILE_FAILED is None:
            try:
                with compile_settings():
                    return compiled(function)(*args)
            except compile_errors() as error:
                compile_failed(error)
        return function(*args)
    return run


# --- CUDA graphs ---
class DecodeGraphs:
    """CUDA graphs of a call's decode step (`GenerateCall.decode`), one per row count, captured the first time it is
    needed.

    Warm-up and capture run with every slot pointing at the stand-in row (always stopped: nothing is
    recorded, its key/value go to the cache's last slot, which no running row reads), and the slots, last
    tokens and step counter are put back afterwards, also when capture fails: capturing never moves a real
    row. A capture that fails (a model whose forward synchronises with the host, say) is said in one line on
    stderr and the call decodes eagerly from there: the same steps, only slower."""

    def __init__(self, call):
        self.call, self.step, self.graphs, self.eager = call, call.decode, {}, False

    def decode(self, n: int) -> None:
        if not self.eager and n not in self.graphs:
            try:
                self.graphs[n] = self.capture(n)
            except RuntimeError as error:
                self.eager = True
                print(f"engine: CUDA graph capture failed, decoding without graphs: {str(error).splitlines()[0]}",
                      file=sys.stderr, flush=True)
        if self.eager:
            self.step(n)
        else:
            self.graphs[n].replay()

    def capture(self, n: int) -> torch.cuda.CUDAGraph:
        call = self.call
        saved = call.slot_rows[:n].clone(), call.last_token[:n].clone(), call.step.clone()
        call.slot_rows[:n] = call.stand_in
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (lazy initialisations, cuBLAS workspaces)
                for _ in range(2):
                    self.step(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(n)
        finally:
            call.slot_rows[:n].copy_(saved[0])  # in place: the graph reads these addresses
            call.last_token[:n].copy_(saved[1])
            call.step.copy_(saved[2])
        return graph
