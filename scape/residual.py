"""This rank's residual e_i (error feedback), on the device or offloaded to CPU memory.

Offloaded, the residual lives in host memory (pinned when CUDA is there) and is streamed through
two device chunk buffers: while chunk c is being updated on the compute stream, chunk c+1 is
copied in and chunk c-1 copied out on a side stream (double buffering), so the PCIe/NVLink-C2C
traffic overlaps the arithmetic. A sparse step streams it once, in and out (the fold, the
clearing of the sent coordinates and the post-step score in one pass); a read-only range (the
score of this rank's own partitions after a dense step) is streamed in only, not back out; the
masked values the all-reduce needs are gathered on the host once per step, from a host copy of
the mask, and sent in one copy (``gather``). On a CPU run the same chunk loop runs without
streams, which is what the tests exercise.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch

DEFAULT_CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32 per device buffer


class Residual:
    def __init__(self, numel: int, device: torch.device, offload: bool,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        self.numel = numel
        self.device = device
        self.offload = offload
        # pinned host memory only where a GPU copies from it (pinning needs CUDA)
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        if not offload:
            self.storage = torch.zeros(numel, dtype=torch.float32, device=device)
            return
        self.storage = torch.zeros(numel, dtype=torch.float32, pin_memory=self._pin)
        self.chunk_numel = max(1, min(chunk_numel, numel))
        self.buffers = [torch.empty(self.chunk_numel, dtype=torch.float32, device=device)
                        for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if self._pin else None
        self._gathered: Optional[torch.Tensor] = None  # pinned staging of ``gather``
        self._gathered_sent = None  # the event after its last copy to the device

    def bounds(self, lo: int = 0, hi: Optional[int] = None) -> List[Tuple[int, int]]:
        """The chunks [start, stop) that cover [lo, hi) (the whole residual by default)."""
        hi = self.numel if hi is None else hi
        if not self.offload:
            return [(0, self.numel)] if lo == 0 and hi == self.numel else [(lo, hi)]
        return [(start, min(start + self.chunk_numel, hi)) for start in range(lo, hi, self.chunk_numel)]

    def chunks(self, lo: int = 0, hi: Optional[int] = None,
               write_back: bool = True) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """Yield (start, stop, device view of e[start:stop]) over [lo, hi); with ``write_back``
        edits to the views persist after the loop (without it the views are to read)."""
        if not self.offload:
            hi = self.numel if hi is None else hi
            yield lo, hi, self.storage if (lo, hi) == (0, self.numel) else self.storage[lo:hi]
        elif self.copy_stream is None:
            for i, (start, stop) in enumerate(self.bounds(lo, hi)):
                buffer = self.buffers[i % 2][:stop - start]
                buffer.copy_(self.storage[start:stop])
                yield start, stop, buffer
                if write_back:
                    self.storage[start:stop].copy_(buffer)
        else:
            yield from self._cuda_chunks(self.bounds(lo, hi), write_back)

    def _cuda_chunks(self, bounds: List[Tuple[int, int]],
                     write_back: bool) -> Iterator[Tuple[int, int, torch.Tensor]]:
        compute, copy = torch.cuda.current_stream(self.device), self.copy_stream
        loaded = [torch.cuda.Event(), torch.cuda.Event()]
        computed = [torch.cuda.Event(), torch.cuda.Event()]

        def load(i: int) -> None:
            lo, hi = bounds[i]
            with torch.cuda.stream(copy):
                # a buffer is reloaded only after the compute stream is done with it (and, in
                # copy-stream order, after its copy-out)
                if i >= 2:
                    copy.wait_event(computed[i % 2])
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
            if write_back:
                with torch.cuda.stream(copy):
                    copy.wait_event(computed[i % 2])
                    self.storage[lo:hi].copy_(buffer, non_blocking=True)
        compute.wait_stream(copy)

    def gather(self, indices: torch.Tensor, host_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A device copy of e[indices] (flat indices on the device), the residual unchanged.

        Offloaded, ``host_indices`` (the same indices in host memory, e.g. the mask's host copy)
        saves a device-to-host copy: the host waits once for the pending copies out, gathers
        into a pinned buffer and sends it in one non-blocking copy.
        """
        if not self.offload:
            return self.storage.index_select(0, indices)
        host = host_indices if host_indices is not None else indices.cpu()
        self.synchronize()
        if not self._pin:
            return self.storage.index_select(0, host).to(self.device)
        if self._gathered_sent is not None:
            self._gathered_sent.synchronize()  # the last step's copy out of the staging buffer
        if self._gathered is None or self._gathered.numel() < host.numel():
            self._gathered = torch.empty(host.numel(), dtype=torch.float32, pin_memory=True)
        staged = self._gathered[:host.numel()]
        torch.index_select(self.storage, 0, host, out=staged)
        values = staged.to(self.device, non_blocking=True)
        self._gathered_sent = torch.cuda.Event()
        self._gathered_sent.record()
        return values

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
