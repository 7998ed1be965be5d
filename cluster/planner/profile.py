"""The per-engine performance profile: what one engine's steps cost.

JSON, ``format: "tandem-profile/1"``::

    {
      "format": "tandem-profile/1",
      "model": "tiny", "device": "cpu", "measured_at": "2026-11-27T01:30:00Z",
      "tensor_parallel_size": 1,              # optional, 1 when absent
      "prefill": {"batch_tokens": [16, 64, 256], "time_s": [0.002, 0.004, 0.011]},
      "decode": {
        "batch_sizes": [1, 4, 16],            # requests in the step
        "context_tokens": [64, 512, 2048],    # KV tokens the batch attends to, all requests
        "time_s": [[...], [...], [...]]       # time_s[i][j]: batch_sizes[i], context_tokens[j]
      },
      "transfer": {"bytes_per_s": 1.0e9, "latency_s": 0.002, "kv_bytes_per_token": 4096},
      "scheduler": {"block_size": 16, "num_kv_blocks": 2048, "max_num_batched_tokens": 2048,
                    "max_num_seqs": 64, "max_model_len": 2048},
      "service": {"request_latency_s": 0.008,
                  "step_overhead_s": [[1, 0.0009], [4, 0.0005], [8, 0.0004]],  # or one number
                  "prefill_overhead_s": 0.002,
                  "prefill_beside_decode_s": [[0, 0.0], [1, 0.004]],  # optional, 0 when absent
                  "prefill_after_idle_s": [[0.02, 0.0], [1.0, 0.003]]},  # optional, 0 when absent
      "host": {"cores": 2, "engine_threads": 1, "cpu_per_token_s": 0.0003,
               "background_cores": 0.0}                                      # optional
    }

Costs between measured points are linear (bilinear on the decode grid).
Below the first point a cost is the first point's; past the last point the
last segment's slope goes on (a step twice as big as any measured costs
about twice as much, never less than the last point). Past the decode grid
each axis adds its own edge slope to the grid's edge value (no slope below
0), so growing batch and context together costs their sum, not a product. The handoff of a
prompt of ``n`` tokens takes ``latency_s + n * kv_bytes_per_token /
bytes_per_s``. ``scheduler`` holds the engine limits the profile was
measured under; the simulator's schedulers use them. ``tensor_parallel_size``
is the engine shape the profile describes (its devices, one engine): ``tandem
plan`` given one profile per size searches the size of each pool.
``service`` (optional) holds what the serving path adds to the engine's own
step: ``request_latency_s`` once per request (the gateway and the hops to the
engine and back before the first token reaches the client) and
``step_overhead_s`` per engine step (the engine loop's work around the step:
outputs sent, inputs read; on a CPU box also a lightly loaded engine's slower
steps), by the step's batch: ``[[batch, seconds], ...]`` pairs from a sweep of
served decode batches (service_curve.py: linear between, flat outside), or
one number for every batch (profiles written before the sweep). A step that
computes prompt tokens takes the batch-1 overhead and ``prefill_overhead_s``
more (a lone served prefill step beyond the profiled one: the engine comes to
a prompt from idle, with cold caches, where ``tandem profile`` times prompts
back to back), and ``prefill_beside_decode_s`` more by the decode streams
running on the decode engines when it starts (``[[streams, seconds], ...]``,
0 at none: a long prompt step on a shared box yields to the short decode
steps beside it), and ``prefill_after_idle_s`` more by the time the engine
sat idle before that step (``[[idle seconds, seconds], ...]``: on a CPU box a
step that follows an idle wait runs slower than one that follows a step;
``prefill_overhead_s`` is then the figure at no idle time). ``tandem profile``
times the engine alone and leaves them 0; benchmarks/simulator.py measures them through a served 1P1D. ``host``
(optional, contention.py) says that the engines share a host's cores and
how: when set, the simulator stretches the steps of engines that compute at
the same time beyond the cores (processor sharing); absent (a GPU
deployment, one engine per device), it does not.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.cluster.planner.contention import HostShare
from tandem.cluster.planner.service_curve import curve_at, curve_json, parse_curve

FORMAT = "tandem-profile/1"
META_KEYS = ("model", "device", "measured_at", "tensor_parallel_size")
SERVICE_FIELDS = ("request_latency_s", "step_overhead_s", "prefill_overhead_s")
# service figures that may be [[count, seconds], ...] curves, and the least count of each
SERVICE_CURVES = {"step_overhead_s": 1, "prefill_beside_decode_s": 0, "prefill_after_idle_s": 0}
# the curves that are lists only, absent (``[]``) meaning 0 everywhere
LIST_CURVES = ("prefill_beside_decode_s", "prefill_after_idle_s")


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)``; constant below ``xs[0]``, the last slope past ``xs[-1]``."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(i, len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, ys[-1]) if x > xs[-1] else y


@dataclass
class TransferCost:
    bytes_per_s: float
    latency_s: float
    kv_bytes_per_token: int

    def seconds(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / self.bytes_per_s


@dataclass
class Profile:
    prefill_tokens: list[float]
    prefill_time_s: list[float]
    decode_batch_sizes: list[float]
    decode_context_tokens: list[float]
    decode_time_s: list[list[float]]
    transfer: TransferCost
    scheduler: dict[str, int] = field(default_factory=dict)
    # model, device, measured_at, tensor_parallel_size
    meta: dict[str, Any] = field(default_factory=dict)
    request_latency_s: float = 0.0
    step_overhead_s: float | list[list[float]] = 0.0  # one number, or by batch (a curve)
    prefill_overhead_s: float = 0.0
    prefill_beside_decode_s: list[list[float]] = field(default_factory=list)  # by streams
    prefill_after_idle_s: list[list[float]] = field(default_factory=list)  # by idle seconds
    host: HostShare | None = None  # engines sharing a host's cores (None: a device each)

    def __post_init__(self) -> None:
        _axis("prefill.batch_tokens", self.prefill_tokens)
        _times("prefill.time_s", self.prefill_time_s, len(self.prefill_tokens))
        _axis("decode.batch_sizes", self.decode_batch_sizes)
        _axis("decode.context_tokens", self.decode_context_tokens)
        if not isinstance(self.decode_time_s, list) or len(self.decode_time_s) != len(
            self.decode_batch_sizes
        ):
            raise ValueError("decode.time_s must have one row per decode.batch_sizes entry")
        for row in self.decode_time_s:
            _times("decode.time_s", row, len(self.decode_context_tokens))
        tp = self.meta.get("tensor_parallel_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError("profile: tensor_parallel_size must be an integer >= 1")
        for name in ("request_latency_s", "prefill_overhead_s"):
            v = getattr(self, name)
            if not _num(v) or v < 0:
                raise ValueError(f"profile: service.{name} must be a number >= 0")
        for name, low in SERVICE_CURVES.items():
            v = getattr(self, name)
            listed = name in LIST_CURVES  # a list only (0 everywhere: absent)
            if not (listed and v == []):
                points = parse_curve(name, v, low, number=not listed)
                setattr(self, name, v if _num(v) else [list(p) for p in points])
        t = self.transfer
        if not _num(t.bytes_per_s) or t.bytes_per_s <= 0:
            raise ValueError("transfer.bytes_per_s must be a number > 0")
        if not _num(t.latency_s) or t.latency_s < 0:
            raise ValueError("transfer.latency_s must be a number >= 0")
        if not _num(t.kv_bytes_per_token) or t.kv_bytes_per_token < 0:
            raise ValueError("transfer.kv_bytes_per_token must be a number >= 0")

    @property
    def tp_size(self) -> int:
        """Devices of one engine (tensor-parallel workers)."""
        return self.meta.get("tensor_parallel_size", 1)

    # ---- costs -------------------------------------------------------------------

    def prefill_s(self, batch_tokens: int) -> float:
        return interp(self.prefill_tokens, self.prefill_time_s, batch_tokens)

    def step_overhead(self, batch: float = 1) -> float:
        """The served loop's overhead on a step of ``batch`` requests."""
        v = self.step_overhead_s
        return v if _num(v) else curve_at(v, batch)

    def step_s(self, engine_step_s: float, batch: float = 1) -> float:
        """A step's time in the served loop: the engine's step and the loop's overhead."""
        return engine_step_s + self.step_overhead(batch)

    def served_prefill_s(self, batch_tokens: int, decoding: int = 0, idle_s: float = 0.0) -> float:
        """A step computing ``batch_tokens`` prompt tokens in the served loop, with
        ``decoding`` streams running on the decode engines beside it, after its
        engine sat ``idle_s`` seconds idle (``inf``: never stepped before)."""
        beside = curve_at(self.prefill_beside_decode_s, decoding)
        idle = curve_at(self.prefill_after_idle_s, idle_s) if self.prefill_after_idle_s else 0.0
        return self.step_s(self.prefill_s(batch_tokens)) + self.prefill_overhead_s + beside + idle

    def decode_s(self, batch_size: float, context_tokens: float) -> float:
        bs, cs = self.decode_batch_sizes, self.decode_context_tokens
        b = min(max(batch_size, bs[0]), bs[-1])
        c = min(max(context_tokens, cs[0]), cs[-1])
        t = self._grid(b, c)
        # past the grid, each axis adds its own edge slope: no cross term, so a
        # batch twice as big with twice the context is not four times as slow
        if batch_size > bs[-1] and len(bs) > 1:
            slope = (self._grid(bs[-1], c) - self._grid(bs[-2], c)) / (bs[-1] - bs[-2])
            t += max(0.0, slope) * (batch_size - bs[-1])
        if context_tokens > cs[-1] and len(cs) > 1:
            slope = (self._grid(b, cs[-1]) - self._grid(b, cs[-2])) / (cs[-1] - cs[-2])
            t += max(0.0, slope) * (context_tokens - cs[-1])
        return t

    def _grid(self, b: float, c: float) -> float:
        """Bilinear inside the decode grid (``b``, ``c`` within its range)."""
        rows = [interp(self.decode_context_tokens, r, c) for r in self.decode_time_s]
        return interp(self.decode_batch_sizes, rows, b)

    def handoff_s(self, num_tokens: int) -> float:
        return self.transfer.seconds(num_tokens)

    # ---- JSON --------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            **self.meta,
            "prefill": {"batch_tokens": self.prefill_tokens, "time_s": self.prefill_time_s},
            "decode": {
                "batch_sizes": self.decode_batch_sizes,
                "context_tokens": self.decode_context_tokens,
                "time_s": self.decode_time_s,
            },
            "transfer": asdict(self.transfer),
            "scheduler": self.scheduler,
            **({"service": self._service_json()} if self._has_service() else {}),
            **({"host": self.host.to_json()} if self.host is not None else {}),
        }

    def _has_service(self) -> bool:
        return any(getattr(self, k) for k in (*SERVICE_FIELDS, *LIST_CURVES))

    def _service_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in SERVICE_FIELDS}
        out["step_overhead_s"] = curve_json(self.step_overhead_s)
        for k in LIST_CURVES:
            if getattr(self, k):
                out[k] = curve_json(getattr(self, k))
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Profile:
        """``ValueError`` naming the field on a bad profile."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"profile: format must be {FORMAT!r}")
        try:
            pre, dec, tr = obj["prefill"], obj["decode"], obj["transfer"]
            svc = obj.get("service") or {}
            return cls(
                prefill_tokens=pre["batch_tokens"],
                prefill_time_s=pre["time_s"],
                decode_batch_sizes=dec["batch_sizes"],
                decode_context_tokens=dec["context_tokens"],
                decode_time_s=dec["time_s"],
                transfer=TransferCost(tr["bytes_per_s"], tr["latency_s"], tr["kv_bytes_per_token"]),
                scheduler=dict(obj.get("scheduler") or {}),
                meta={k: obj[k] for k in META_KEYS if k in obj},
                **{k: svc.get(k, 0.0) for k in SERVICE_FIELDS},
                **{k: svc.get(k, []) for k in LIST_CURVES},
                host=HostShare.from_json(obj["host"]) if obj.get("host") is not None else None,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile: missing or malformed field {exc}") from None


def load_profile(path: str) -> Profile:
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--profile {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--profile {path}: not JSON ({exc.msg})") from None
    try:
        return Profile.from_json(obj)
    except ValueError as exc:
        raise ValueError(f"--profile {path}: {exc}") from None


def save_profile(profile: Profile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=2)
        f.write("\n")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _axis(name: str, xs: Any) -> None:
    if not isinstance(xs, list) or not xs or not all(_num(x) and x > 0 for x in xs):
        raise ValueError(f"profile: {name} must be a non-empty list of numbers > 0")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"profile: {name} must be strictly increasing")


def _times(name: str, ys: Any, n: int) -> None:
    if not isinstance(ys, list) or len(ys) != n or not all(_num(y) and y >= 0 for y in ys):
        raise ValueError(f"profile: {name} must hold {n} numbers >= 0")
