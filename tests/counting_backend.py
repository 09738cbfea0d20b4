"""A device whose memory is counted as the CUDA allocator counts it, on CPU: torch.cuda's memory functions over
live tensor bytes (benchmarks.memory.LiveTensorBytes), for launch/memory.py's glue in tests."""
from benchmarks.memory import LiveTensorBytes


class CountingBackend:
    """torch.cuda's memory functions over live tensor bytes (LiveTensorBytes): `free` bytes free on the device."""

    def __init__(self, live: LiveTensorBytes, free: int):
        self.live, self.free = live, free

    def mem_get_info(self, device):
        return self.free, 2 * self.free

    def memory_allocated(self, device):
        return self.live.live

    memory_reserved = memory_allocated  # no cache

    def reset_peak_memory_stats(self, device):
        self.live.peak = self.live.live

    def max_memory_allocated(self, device):
        return self.live.peak

    def synchronize(self, device):
        pass

    def empty_cache(self):
        pass
