"""Host writes to a pinned staging buffer ordered after the device copy that last read it.

The graphs' static inputs are built in a pinned host buffer and sent with a ``non_blocking``
copy, queued behind whatever the GPU has not run yet. Writing the buffer again before that copy
ran would send the NEXT step's inputs to this step's kernels. The step's sampled-token read
usually orders the two, but not in a step that samples nothing (a prompt chunk that does not
end its prompt: every step of a long chunked prefill) or in an overlapped loop::

    fill(step N): host <- N; copy queued; event recorded after it
    fill(step N+1): event done? yes: write (the usual case, no wait)
                                no:  wait for it, then write

Off CUDA the copy is synchronous and the guard does nothing.
"""

from __future__ import annotations

import torch


class CopyGuard:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def before_write(self) -> None:
        """Wait until the last recorded copy ran, if it has not yet (querying is free)."""
        if self.event is not None and not self.event.query():
            self.event.synchronize()

    def after_copy(self) -> None:
        """Record, on the device's current stream, that the copy just queued must run first."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
