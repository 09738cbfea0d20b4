"""How big and how slow a checkpoint of Qwen2.5-0.5B is: `python tools/checkpoint_size.py` (random weights, CPU).

One AdamW step (so that both moments exist), then checkpoint.fingerprint and checkpoint.save into a temporary
folder; prints the parameter count, the seconds each took and the bytes on disk. Needs ~9 GB of memory.
"""
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import qwen_05b_shaped  # noqa: E402
from infra import checkpoint  # noqa: E402
from infra.tiny import tiny_tokenizer  # noqa: E402
from infra.command_line import parse_args  # noqa: E402


def main() -> None:
    policy = qwen_05b_shaped(tiny=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    policy(torch.tensor([[1, 2, 3, 4]])).logits.float().mean().backward()
    optimizer.step()
    out = Path(tempfile.mkdtemp())
    try:
        start = time.perf_counter()
        theta_0 = checkpoint.fingerprint(policy)
        fingerprint_s, start = time.perf_counter() - start, time.perf_counter()
        path = checkpoint.save(out, 1, policy, tiny_tokenizer(), optimizer, parse_args([]), theta_0)
        save_s = time.perf_counter() - start
        size = int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()[0])
        print(f"parameters {sum(p.numel() for p in policy.parameters()) / 1e6:.1f} M; "
              f"fingerprint {fingerprint_s:.1f} s; save {save_s:.1f} s; checkpoint {size / 1e9:.2f} GB")
    finally:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
