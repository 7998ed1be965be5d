"""Torch profiler traces of one engine, on request (``POST /start_profile``,
``POST /stop_profile`` on the gateway; vLLM's routes of the same names).

Off unless the engine has a ``profile_dir`` (``--profile-dir``): a trace
holds every op of the engine process and is large, so it is written only
where an operator asked. ``start`` begins a ``torch.profiler`` session (CPU,
and CUDA where the engine runs on it) on the engine's loop thread; ``stop``
ends it and writes a Chrome trace ``<dir>/<engine_id>-<epoch>-<n>.json``
(open it in Perfetto or chrome://tracing). Loop thread only.
"""

from __future__ import annotations

import os
from typing import Any


class EngineProfiler:
    def __init__(self, profile_dir: str | None, engine_id: str, epoch: int, device: str) -> None:
        self.profile_dir = profile_dir
        self.engine_id = engine_id
        self.epoch = epoch
        self.device = device
        self._prof: Any = None
        self.num_traces = 0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def _check_on(self) -> str:
        if not self.profile_dir:
            raise ValueError(
                f"engine {self.engine_id}: profiling is off (start tandem serve with --profile-dir)"
            )
        return self.profile_dir

    def start(self) -> bool:
        """Begin a trace; False if one runs already."""
        self._check_on()
        if self._prof is not None:
            return False
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.start()
        return True

    def stop(self) -> str | None:
        """End the trace and write it; its path (None if none ran)."""
        directory = self._check_on()
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        prof.stop()
        os.makedirs(directory, exist_ok=True)
        self.num_traces += 1
        path = os.path.join(directory, f"{self.engine_id}-{self.epoch}-{self.num_traces}.json")
        prof.export_chrome_trace(path)
        return path
