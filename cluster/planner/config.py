"""The running planner's settings: a section of the serve configuration
(``--planner off|load|sla`` and its thresholds; ``cluster/planner/autoscale.py``
decides, ``runner.py`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire.config_fields import option

PLANNER_MODES = ("off", "load", "sla")


@dataclass(frozen=True)
class PlannerConfig:
    planner: str = option(
        "off",
        help="resize the pools while serving: off; load (queue depth and KV usage "
        "thresholds, with hysteresis and cooldowns); sla (the fewest engines whose "
        "predicted TTFT / ITL p90 meet --ttft-slo-ms / --itl-slo-ms, from "
        "--planner-profile); each pool needs --POOL-max-engines",
    )
    planner_interval_s: float = option(10.0, help="seconds between the planner's decisions")
    planner_watch_interval_s: float = option(
        1.0,
        help="sla: between decisions, look this often for a measured SLO breach (the prefill "
        "queue's wait, the decode engines' step time) and re-plan at once on one; 0: off",
    )
    planner_queue_high: float = option(
        4.0, help="load: scale a pool out when its requests waiting per ready engine exceed this"
    )
    planner_queue_low: float = option(
        0.5, help="load: scale in only while waiting requests per engine are at most this"
    )
    planner_kv_high: float = option(
        0.85, help="load: scale out when the pool's mean KV cache usage (0-1) exceeds this"
    )
    planner_kv_low: float = option(
        0.4, help="load: scale in only while the mean KV cache usage is below this"
    )
    planner_scale_out_cooldown_s: float = option(
        30.0, help="after a pool changed, wait this long before adding to it again"
    )
    planner_scale_in_cooldown_s: float = option(
        120.0, help="after a pool changed, wait this long before removing from it"
    )
    ttft_slo_ms: float = option(1000.0, help="sla: the TTFT p90 to keep")
    itl_slo_ms: float = option(100.0, help="sla: the inter-token latency p90 to keep")
    planner_profile: str | None = option(
        None,
        default_text="none (needed by --planner sla)",
        help="sla: the engine performance profile (JSON from tandem profile)",
    )
    planner_warmup_steps: int = option(
        32,
        help="sla: an engine's steps before this many are its cold start and do not count "
        "as its speed",
    )

    def __post_init__(self) -> None:
        if self.planner not in PLANNER_MODES:
            raise ValueError(
                f"planner (--planner) must be one of {', '.join(PLANNER_MODES)}, "
                f"got {self.planner!r}"
            )
        for key in (
            "planner_interval_s",
            "ttft_slo_ms",
            "itl_slo_ms",
            "planner_queue_high",
            "planner_kv_high",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} (--{key.replace('_', '-')}) must be > 0")
        for key in (
            "planner_queue_low",
            "planner_kv_low",
            "planner_scale_out_cooldown_s",
            "planner_scale_in_cooldown_s",
            "planner_warmup_steps",
            "planner_watch_interval_s",
        ):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} (--{key.replace('_', '-')}) must be >= 0")
        if self.planner_queue_low >= self.planner_queue_high:
            raise ValueError("planner_queue_low must be below planner_queue_high (hysteresis)")
        if self.planner_kv_low >= self.planner_kv_high or self.planner_kv_high > 1:
            raise ValueError("planner_kv_low must be below planner_kv_high, which is at most 1")
        if self.planner == "sla" and not self.planner_profile:
            raise ValueError("planner_profile (--planner-profile FILE) is needed by --planner sla")
