"""`python bench.py publish`: the cost of moving θ_k to the inference process.

`WeightBuffer.publish` (copy into shared memory), `load_into` when the inference model's
parameters alias the buffer (CPU: a version check) and when they do not (GPU/NPU: one copy), a
plain memcpy of the same bytes, and the alternative of sending a pickled state_dict through a
multiprocessing queue to a spawned process. For the tiny model and a Qwen2.5-0.5B-shaped random
model (494 M parameters, fp32).
"""
from __future__ import annotations

import argparse
import copy
import pickle
import time

import torch

from benchmarks.common import count, median_seconds, qwen_05b_shaped, write_json


def _receive_pickled(q, done):
    """Child process: receive a pickled state_dict, unpickle it, report the time it finished."""
    done.put("ready")  # start-up (importing torch) is not part of the cost being measured
    blob = q.get()
    pickle.loads(blob)
    done.put(time.perf_counter())


def publish_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=count(), default=5, help="timed repeats; the median is reported")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def publish(args: argparse.Namespace) -> bool:
    """Cost of publishing θ through the shared-memory buffer vs memcpy vs a pickled state_dict on a queue."""
    import torch.multiprocessing as mp

    from weights import WeightBuffer
    results = {}
    print(f"{'model':22s} {'MB':>7s} {'publish':>8s} {'load(view)':>10s} {'load(copy)':>10s} {'memcpy':>8s} "
          f"{'pickle+queue':>12s}   (seconds, median of {args.repeats})")
    for name, tiny in (("tiny", True), ("qwen2.5-0.5b-shaped", False)):
        model = qwen_05b_shaped(tiny)
        buffer = WeightBuffer(model)
        receiver = copy.deepcopy(model) if tiny else qwen_05b_shaped(False)
        nbytes = buffer.flat.numel() * buffer.flat.element_size()
        src, dst = torch.empty_like(buffer.flat), torch.empty_like(buffer.flat)
        publish = median_seconds(lambda: buffer.publish(model, 1), args.repeats)
        aliased = copy.deepcopy(receiver) if tiny else receiver
        buffer.attach(aliased)
        load_view = median_seconds(lambda: buffer.load_into(aliased, 1), args.repeats)
        buffer.aliased = False  # as on a GPU: a real copy into the receiver's own parameters
        copy_target = copy.deepcopy(model)
        load_copy = median_seconds(lambda: buffer.load_into(copy_target, 1), args.repeats)
        memcpy = median_seconds(lambda: dst.copy_(src), args.repeats)
        context = mp.get_context("spawn")
        q, done = context.Queue(), context.Queue()
        child = context.Process(target=_receive_pickled, args=(q, done), daemon=True)
        child.start()
        done.get()
        start = time.perf_counter()
        q.put(pickle.dumps(model.state_dict()))
        pickled = done.get() - start
        child.join()
        results[name] = {"bytes": nbytes, "publish_s": publish, "load_view_s": load_view, "load_copy_s": load_copy,
                         "memcpy_s": memcpy, "pickle_queue_s": pickled}
        print(f"{name:22s} {nbytes / 2**20:7.1f} {publish:8.4f} {load_view:10.6f} {load_copy:10.4f} {memcpy:8.4f} "
              f"{pickled:12.3f}", flush=True)
    write_json(args.json, results)
    return True
