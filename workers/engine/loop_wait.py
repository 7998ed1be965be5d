"""How long the engine loop waits on its input socket between steps.

::

    last step computed tokens        -> 0 ms   (keep the batch going)
    nothing computed, transfers or
    held blocks to poll              -> 1, 2, 4, 8 ms ... (doubling while
                                        nothing happens)
    nothing at all                   -> 100 ms (heartbeats, a lost gateway's
                                        check; control calls and shutdown wake
                                        the loop at once: EngineService._wake)

Any input or output resets the wait to its shortest. Waiting for remote KV
(or for a decode engine to pull held blocks) used to poll every step
without waiting (a request waiting for KV counted as unfinished), about
half a core per engine; ``benchmarks/engine_idle_cpu.py`` measures it. The
longest wait while transfers are pending bounds what a finished READ or
a "done" notification can be delayed by (UCX ``cma`` on one host finishes a
READ inside the step that posts it, so there it adds nothing).
"""

from __future__ import annotations

MAX_PENDING_WAIT_MS = 8
IDLE_WAIT_MS = 100


class LoopWait:
    def __init__(self) -> None:
        self._pending_ms = 0
        self._fresh = False

    def reset(self) -> None:
        """Something happened (input, outputs): step at once next time."""
        self._pending_ms = 0
        self._fresh = True

    def next_ms(self, has_work: bool, computed: bool) -> int:
        """Milliseconds to wait before the next step."""
        if not has_work:
            self._pending_ms, self._fresh = 0, False
            return IDLE_WAIT_MS
        if computed or self._fresh:
            self._pending_ms, self._fresh = 0, False
            return 0
        self._pending_ms = min(max(1, 2 * self._pending_ms), MAX_PENDING_WAIT_MS)
        return self._pending_ms
