"""What the entropy metric costs a training step: `python tools/entropy_cost.py` (random weights, CPU, one thread).

A Qwen2.5-0.5B-wide model (2 layers, its 151,936-token vocabulary: the logits dominate), 2 groups of a 150-token
prompt and 8 responses of 48 tokens, packed; a forward/backward of the summed log-probs with and without
`entropy=True` (attention.token_logprobs measures H from the logits chunk it already holds), interleaved, medians.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import packing  # noqa: E402
from benchmarks.common import qwen_05b_shaped  # noqa: E402


def main(rounds: int = 5) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = qwen_05b_shaped(tiny=False, layers=2)
    model.config._attn_implementation = "sdpa"
    groups = [(torch.randint(0, 1000, (150,)), [torch.randint(0, 1000, (48,)) for _ in range(8)]) for _ in range(2)]

    def step(entropy: bool) -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        logp = packing.batch_logprobs(model, groups, "packed", entropy=entropy)[0]  # (16, 48)
        logp.sum().backward()
        return time.perf_counter() - start

    step(False), step(True)  # warm-up
    seconds = {False: [], True: []}
    for _ in range(rounds):
        for entropy in (False, True):
            seconds[entropy].append(step(entropy))
    without, with_entropy = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"step without the entropy {without:.2f} s, with it {with_entropy:.2f} s: x{with_entropy / without:.3f}")


if __name__ == "__main__":
    main()
