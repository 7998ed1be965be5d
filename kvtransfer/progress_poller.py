"""Drive NIXL/UCX progress on the prefill side while its engine loop is busy.

A decode engine's READ of a prefill engine's KV is one-sided only on some
UCX transports. Which ones need the prefill process to take part (measured
with ``tests/kvtransfer/test_progress_while_blocked.py`` and the GPU report
of issue #10)::

    transport (UCX)               P must progress?   without it, P blocked 5 s
    cma (DRAM, one host)          no                 READ done inside the post
    tcp (DRAM, between hosts or   yes                READ pending until P calls
      UCX_TLS=tcp)                                   into NIXL again
    cuda_ipc / rc (VRAM)          yes (GPU report)   still pending after 15 s

The engine loop calls NIXL every step, but a long forward (or anything else
that keeps the loop away) stalls every READ aimed at this engine. Two ways
out, chosen by ``KVTransferConfig``:

* this poller (default): a Python thread that, only while this engine holds
  blocks for a decode engine, calls into NIXL every ``interval_s``. It needs
  the GIL for microseconds per call, which torch ops, CUDA syncs and
  ``time.sleep`` release and a pure-Python loop hands over every 5 ms; a C
  call that holds the GIL for seconds starves it.
* NIXL's own progress thread (``nixl_progress_thread=True``): C++, needs no
  GIL, so it also covers that case; through NIXL's Python API it polls UCX
  with a zero timeout, i.e. it keeps a core busy whenever it is scheduled.

Notifications received by a progress call are not lost: ``NixlAgent`` keeps
them until the loop's ``get_notifs``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ProgressPoller:
    """Calls ``progress()`` every ``interval_s`` while ``is_needed()``.

    ``is_needed`` and ``progress`` run on the poller's thread; ``progress``
    must be thread-safe against the engine loop (``NixlAgent`` serialises its
    NIXL calls behind one lock). ``wake()`` (any thread) makes an idle poller
    re-check ``is_needed`` at once; ``close()`` stops and joins the thread.
    """

    def __init__(
        self,
        progress: Callable[[], object],
        is_needed: Callable[[], bool],
        interval_s: float,
        idle_check_s: float = 0.05,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"ProgressPoller.interval_s must be > 0, got {interval_s!r}")
        self._progress = progress
        self._is_needed = is_needed
        self._interval_s = interval_s
        self._idle_check_s = max(idle_check_s, interval_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_progress_calls = 0
        self.num_errors = 0
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._is_needed():
                try:
                    self._progress()
                    self.num_progress_calls += 1
                except Exception:  # noqa: BLE001 - the loop's own calls report errors
                    self.num_errors += 1
                    if self.num_errors == 1:
                        logger.exception("NIXL progress call failed (logged once)")
                self._stop.wait(self._interval_s)
            else:
                self._wake.wait(self._idle_check_s)
                self._wake.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; returns once it has exited (or after ``timeout_s``)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
