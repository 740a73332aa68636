"""This rank's residual e_i (error feedback), on the device or offloaded to CPU memory.

Offloaded, the residual is streamed through two device chunk buffers: while chunk c is being
updated on the compute stream, chunk c+1 is copied in and chunk c-1 copied out on a side stream
(double buffering), so the PCIe/NVLink-C2C traffic overlaps the arithmetic. On a CPU run the same
chunk loop runs without streams, which is what the tests exercise.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

DEFAULT_CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32 per device buffer


class Residual:
    def __init__(self, numel: int, device: torch.device, offload: bool,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        self.numel = numel
        self.device = device
        self.offload = offload
        on_cuda = device.type == "cuda"
        if not offload:
            self.storage = torch.zeros(numel, dtype=torch.float32, device=device)
            return
        self.storage = torch.zeros(numel, dtype=torch.float32, pin_memory=on_cuda)
        self.chunk_numel = max(1, min(chunk_numel, numel))
        self.buffers = [torch.empty(self.chunk_numel, dtype=torch.float32, device=device)
                        for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if on_cuda else None

    def bounds(self) -> List[Tuple[int, int]]:
        if not self.offload:
            return [(0, self.numel)]
        return [(lo, min(lo + self.chunk_numel, self.numel))
                for lo in range(0, self.numel, self.chunk_numel)]

    def chunks(self) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """Yield (lo, hi, device view of e[lo:hi]); edits to the view persist after the loop."""
        if not self.offload:
            yield 0, self.numel, self.storage
        elif self.copy_stream is None:
            for i, (lo, hi) in enumerate(self.bounds()):
                buffer = self.buffers[i % 2][:hi - lo]
                buffer.copy_(self.storage[lo:hi])
                yield lo, hi, buffer
                self.storage[lo:hi].copy_(buffer)
        else:
            yield from self._cuda_chunks()

    def _cuda_chunks(self) -> Iterator[Tuple[int, int, torch.Tensor]]:
        bounds = self.bounds()
        compute, copy = torch.cuda.current_stream(self.device), self.copy_stream
        loaded = [torch.cuda.Event(), torch.cuda.Event()]
        computed = [torch.cuda.Event(), torch.cuda.Event()]

        def load(i: int) -> None:
            lo, hi = bounds[i]
            with torch.cuda.stream(copy):
                # copy-stream order puts this after chunk i-2's copy-out from the same buffer
                self.buffers[i % 2][:hi - lo].copy_(self.storage[lo:hi], non_blocking=True)
                loaded[i % 2].record(copy)

        load(0)
        for i, (lo, hi) in enumerate(bounds):
            if i + 1 < len(bounds):
                load(i + 1)
            compute.wait_event(loaded[i % 2])
            buffer = self.buffers[i % 2][:hi - lo]
            yield lo, hi, buffer
            computed[i % 2].record(compute)
            with torch.cuda.stream(copy):
                copy.wait_event(computed[i % 2])
                self.storage[lo:hi].copy_(buffer, non_blocking=True)
        compute.wait_stream(copy)

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """A device copy of e[indices] (flat indices on the device), the residual unchanged."""
        if not self.offload:
            return self.storage.index_select(0, indices)
        self.synchronize()
        return self.storage.index_select(0, indices.cpu()).to(self.device, non_blocking=True)

    def synchronize(self) -> None:
        """Make host-side reads of ``storage`` safe (pending copies out have landed)."""
        if self.offload and self.copy_stream is not None:
            self.copy_stream.synchronize()

    def cpu_copy(self) -> torch.Tensor:
        self.synchronize()
        return self.storage.detach().to("cpu", copy=True)

    def load(self, values: torch.Tensor) -> None:
        if values.shape != self.storage.shape:
            raise ValueError(f"SCAPE residual in the checkpoint has {values.numel()} values, this "
                             f"model's padded flat buffer has {self.numel}")
        self.synchronize()
        self.storage.copy_(values)

    def norm(self) -> float:
        self.synchronize()
        return float(torch.linalg.vector_norm(self.storage))
