"""What a stale routing view costs in prefix hit rate: N gateways, one fleet.

Each gateway of ``tandem serve --api-server-count N`` routes with its own
``RoutingPolicy`` (kv-aware), its own ``PrefixIndex`` and its own engine
counters (docs/architecture.md, "Several gateways"):

  prefix index     fed by every engine's KV event stream; a prompt's blocks
                   arrive one engine step after they were computed, plus
                   the PUB/SUB hop (``--event-delay-ms``)
  running/waiting  the engines' stats, refreshed once per health interval
                   (0.5 s) on every gateway, at its own phase
  in flight, queued prefill tokens
                   counted by each gateway for its own requests only

This replays the routing benchmark's synthetic chat/RAG trace
(``cluster/cli/trace_replay.py`` SynthConfig, 184 requests, the same seed as
``benchmarks/routing.py``) through the real policy and index over a
simulated pool of 4 colocated engines, in simulated time: an engine holds
a prompt's blocks from the end of its prefill (uncached tokens at
``PREFILL_TOK_S``), runs ``output_len x TPOT_S`` more, never evicts (the
routing benchmark sizes pools to hold the trace). Each request goes to a
gateway drawn at random (SO_REUSEPORT spreads connections by hash).
Reported: the hit rate the engines would report (prompt tokens found in the
chosen engine's cache when the request arrives) against the trace's
oracle, and the busiest engine's share of requests.

Second table: the in-flight counts shared between gateways, as
``tandem serve --api-server-count N`` does (``cluster/routing/peer_load.py``):
each simulated gateway runs the real ``PeerLoadChannel`` (Unix datagram
sockets in a temporary directory) on the simulated clock. A change of its
counters schedules a flush at most every ``--share-min-interval-ms``; the
datagrams reach the other gateways' sockets at once and are read
``HOP_S`` later (a socket hop and a loop turn); heartbeats every 0.5 s;
stats still every 0.5 s. Against it: nothing shared (each gateway its
own counters), and the oracle: one set of engine counters for all
gateways, stats read fresh at each decision, so only the prefix index is
per gateway. Each figure is the mean over ``--seeds`` draws of which
gateway takes each request and of the timers' phases (one draw swings by
several points at 20x).

No engines, no HTTP: the figure is the routing decision alone; the same
decisions cost the same prefill tokens on real engines.

Run: python benchmarks/routing_staleness.py [--time-scale 1.0 0.25] [--share-min-interval-ms 5 50]
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.cli.trace_replay import (  # noqa: E402
    SynthConfig,
    TraceRequest,
    oracle_hit_tokens,
    synthesize,
    synthesize_prompt,
)
from tandem.cluster.routing.index import PrefixIndex  # noqa: E402
from tandem.cluster.routing.peer_load import PeerLoadChannel  # noqa: E402
from tandem.cluster.routing.policy import RoutingConfig, RoutingPolicy, max_hit_blocks  # noqa: E402
from tandem.cluster.routing.router import Router  # noqa: E402
from tandem.scheduler.block_hash import hash_request_blocks  # noqa: E402
from tandem.scheduler.kv_events import BlockStored, KVEventBatch  # noqa: E402

NUM_ENGINES = 4
BLOCK_TOKENS = 64
CAPACITY_BLOCKS = 8192  # benchmarks/routing.py's pools: the trace fits
MAX_NUM_SEQS = 32
PREFILL_TOK_S = 20_000.0  # uncached prompt tokens per second per engine
TPOT_S = 0.02  # per output token
STATS_INTERVAL_S = 0.5  # the health interval: engine stats reach each gateway
HOP_S = 0.0005  # a datagram between gateways read: socket hop + the reader's loop turn
VOCAB_SIZE = 256
SEED = 0


@dataclass
class Engine:
    engine_id: str
    cache: set[bytes] = field(default_factory=set)
    running: int = 0
    seq: int = 0


@dataclass
class GatewayView:
    router: Router
    index: PrefixIndex
    policy: RoutingPolicy


def make_gateway(engines: list[Engine], router: Router | None = None) -> GatewayView:
    """A gateway's view; ``router`` given: its engine counters are shared
    (the diagnostic rows: what the load view alone costs)."""
    index = PrefixIndex()
    for e in engines:
        index.add_engine(e.engine_id, "colocated", CAPACITY_BLOCKS)
    if router is None:
        router = Router()
        for e in engines:
            st = router.add(e.engine_id, "colocated")
            st.ready, st.max_num_seqs = True, MAX_NUM_SEQS
    policy = RoutingPolicy(RoutingConfig(router="kv-aware"), router, index, "kv-aware")
    return GatewayView(router, index, policy)


def simulate(
    rows: list[dict], prompts_hashes: list[list[bytes]], num_gateways: int,
    event_delay_s: float, time_scale: float, shared_load: bool = False,
    share_min_interval_s: float | None = None, seed: int = SEED,
) -> dict:  # fmt: skip
    """``shared_load``: the oracle (one set of counters, fresh stats);
    ``share_min_interval_s``: the gateways share their counts with the real
    ``PeerLoadChannel``, flushing at most that often."""
    engines = [Engine(f"colocated-{i}") for i in range(NUM_ENGINES)]
    by_id = {e.engine_id: e for e in engines}
    gateways = [make_gateway(engines) for _ in range(num_gateways)]
    if shared_load:  # one set of counters, fresh stats: only the indexes are per gateway
        gateways = [gateways[0], *(make_gateway(engines, gateways[0].router) for _ in gateways[1:])]
    rng = random.Random(seed)  # which gateway takes each request, the timers' phases
    queue: list[tuple[float, int, str, tuple]] = []
    order = iter(range(10**9))
    now_s = 0.0

    def at(t_s: float, kind: str, *args) -> None:
        heapq.heappush(queue, (t_s, next(order), kind, args))

    for i, row in enumerate(rows):
        at(row["timestamp"] / 1000 * time_scale, "arrive", i)
    for g, _ in enumerate(gateways):  # each gateway polls stats at its own phase
        at(rng.uniform(0, STATS_INTERVAL_S), "stats", g)
    channels: list[PeerLoadChannel] = []
    flush_due: list[bool] = [False] * num_gateways
    share_dir = tempfile.TemporaryDirectory(prefix="routing-staleness-")
    if share_min_interval_s is not None and num_gateways > 1:
        for g, view in enumerate(gateways):
            ch = PeerLoadChannel(
                share_dir.name, g, view.router,
                min_interval_s=share_min_interval_s, clock=lambda: now_s,
            )  # fmt: skip
            channels.append(ch)
        for g, ch in enumerate(channels):
            ch.open()
            at(rng.uniform(0, ch.heartbeat_s), "heartbeat", g)

    def changed(g: int) -> None:  # PeerLoadChannel.changed on a loop
        if channels and not flush_due[g]:
            flush_due[g] = True
            at(channels[g].flush_at(now_s), "flush", g)

    def sent(g: int) -> None:  # the others' readers wake
        for h in range(num_gateways):
            if h != g:
                at(now_s + HOP_S, "receive", h)

    num_hit = num_prompt = 0

    def read_stats(router: Router) -> None:
        for st in router.engines.values():
            e = by_id[st.engine_id]
            st.num_running = e.running
            st.kv_cache_usage = len(e.cache) / CAPACITY_BLOCKS

    placed: Counter[str] = Counter()
    share_s, num_received = 0.0, 0  # the real channel's cost (this machine, wall time)
    num_left = len(rows)
    while num_left:
        t_s, _, kind, args = heapq.heappop(queue)
        now_s = t_s
        if kind == "arrive":
            (i,) = args
            g = rng.randrange(num_gateways)
            view = gateways[g]
            if shared_load:
                read_stats(view.router)
            hashes = prompts_hashes[i]
            n = rows[i]["input_length"]
            choice = view.policy.choose("colocated", n, hashes, block_size=BLOCK_TOKENS)
            assert choice is not None
            e = by_id[choice.engine.engine_id]
            hit_blocks = 0
            for h in hashes[: max_hit_blocks(n, BLOCK_TOKENS)]:
                if h not in e.cache:
                    break
                hit_blocks += 1
            hit = hit_blocks * BLOCK_TOKENS
            num_hit, num_prompt = num_hit + hit, num_prompt + n
            placed[e.engine_id] += 1
            e.running += 1
            st = choice.engine
            st.num_inflight += 1
            queued = n - choice.predicted_hit_tokens
            st.queued_prefill_tokens += queued
            changed(g)
            prefill_s = (n - hit) / PREFILL_TOK_S
            at(t_s + prefill_s, "prefilled", i, e.engine_id, g, queued)
            at(t_s + prefill_s + rows[i]["output_length"] * TPOT_S, "done", e.engine_id, g)
        elif kind == "prefilled":
            i, eid, g, queued = args
            e = by_id[eid]
            new = [h for h in prompts_hashes[i] if h not in e.cache]
            e.cache.update(new)
            e.seq += 1
            batch = KVEventBatch(eid, 1, e.seq, t_s, [BlockStored(new, None, BLOCK_TOKENS)])
            for view in gateways:
                at(t_s + event_delay_s, "event", view, batch)
            gateways[g].router.engines[eid].queued_prefill_tokens -= queued
            changed(g)
        elif kind == "event":
            view, batch = args
            view.index.apply(batch)
        elif kind == "done":
            eid, g = args
            by_id[eid].running -= 1
            gateways[g].router.engines[eid].num_inflight -= 1
            changed(g)
            num_left -= 1
        elif kind == "stats":
            (g,) = args
            read_stats(gateways[g].router)
            at(t_s + STATS_INTERVAL_S, "stats", g)
        elif kind == "flush":
            (g,) = args
            flush_due[g] = False
            t0 = time.perf_counter()
            if channels[g].publish(now_s):
                sent(g)
            share_s += time.perf_counter() - t0
            if channels[g].owes_peers:
                changed(g)
        elif kind == "receive":
            (g,) = args
            t0 = time.perf_counter()
            num_received += channels[g].receive(now_s)
            share_s += time.perf_counter() - t0
            if channels[g].owes_peers:  # a new peer: answered at once
                changed(g)
        elif kind == "heartbeat":
            (g,) = args
            channels[g].heartbeat(now_s)
            sent(g)
            at(t_s + channels[g].heartbeat_s, "heartbeat", g)
    num_sends = sum(c.num_sends for c in channels)
    for c in channels:
        c.close()
    share_dir.cleanup()
    return {
        "sends_per_s": num_sends / max(now_s, 1e-9),
        "us_per_datagram": share_s / max(num_received, 1) * 1e6,
        "hit_rate": num_hit / num_prompt,
        "busiest_share": max(placed.values()) / len(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--event-delay-ms", type=float, nargs="+", default=[0, 5, 100, 500])
    parser.add_argument(
        "--time-scale",
        type=float,
        nargs="+",
        default=[1.0, 0.25, 0.05],
        help="trace time multiplier (0.05: the same requests 20x as fast)",
    )
    parser.add_argument(
        "--share-min-interval-ms",
        type=float,
        nargs="+",
        default=[5],
        help="the gateways' in-flight flush batching (peer_load.MIN_INTERVAL_S: 5)",
    )
    parser.add_argument("--seeds", type=int, default=10, help="draws averaged, second table")
    args = parser.parse_args()
    rows = synthesize(SynthConfig(seed=SEED))
    prompts_hashes = []
    for i, row in enumerate(rows):
        req = TraceRequest(row["timestamp"] / 1000, row["input_length"], 1, row["hash_ids"])
        tokens = synthesize_prompt(req, i, VOCAB_SIZE, SEED, BLOCK_TOKENS)
        prompts_hashes.append(hash_request_blocks(tokens, BLOCK_TOKENS))
    oracle = oracle_hit_tokens(rows, BLOCK_TOKENS) / sum(r["input_length"] for r in rows)
    print("routing_staleness: kv-aware hit rate with N gateways' stale views (simulated fleet)")
    print(f"machine: {machine()}")
    print(
        f"trace: SynthConfig(seed={SEED}), {len(rows)} requests, oracle hit rate {oracle:.3f}; "
        f"{NUM_ENGINES} colocated engines, prefill {PREFILL_TOK_S:.0f} tok/s, TPOT "
        f"{TPOT_S * 1000:.0f} ms, stats every {STATS_INTERVAL_S} s per gateway"
    )
    header = (
        "| time scale | gateways | KV event delay ms | hit rate | of oracle | vs 1 gateway fresh "
        "| busiest engine share |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for time_scale in args.time_scale:
        fresh = simulate(rows, prompts_hashes, 1, 0.0, time_scale)["hit_rate"]
        for num_gateways in args.gateways:
            for delay_ms in args.event_delay_ms:
                r = simulate(rows, prompts_hashes, num_gateways, delay_ms / 1000, time_scale)
                print(
                    f"| {time_scale:>10} | {num_gateways:>8} | {delay_ms:>17.0f} "
                    f"| {r['hit_rate']:>8.3f} | {r['hit_rate'] / oracle:>9.3f} "
                    f"| {r['hit_rate'] - fresh:>+18.3f} | {r['busiest_share']:>20.2f} |"
                )
    print()
    seeds = range(args.seeds)
    print(
        f"in-flight counts shared (cluster/routing/peer_load.py), KV events 5 ms late, mean of "
        f"{args.seeds} draws of gateway and timer phase; recovered: (shared - nothing shared) / "
        "(oracle - nothing shared) where that gap is over 0.005"
    )
    header = (
        "| time scale | gateways | batching ms | nothing shared | shared | oracle "
        "| recovered | shared of oracle | datagrams/s per gateway | µs per datagram |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")

    def mean_of(num_gateways: int, time_scale: float, **kw) -> dict:
        runs = [
            simulate(rows, prompts_hashes, num_gateways, 0.005, time_scale, seed=s, **kw)
            for s in seeds
        ]
        return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}

    for time_scale in args.time_scale:
        for num_gateways in args.gateways:
            plain = mean_of(num_gateways, time_scale)["hit_rate"]
            best = mean_of(num_gateways, time_scale, shared_load=True)["hit_rate"]
            for interval_ms in args.share_min_interval_ms if num_gateways > 1 else [0]:
                r = mean_of(num_gateways, time_scale, share_min_interval_s=interval_ms / 1000)
                gap = best - plain
                recovered = f"{(r['hit_rate'] - plain) / gap:.2f}" if gap > 0.005 else "-"
                print(
                    f"| {time_scale:>10} | {num_gateways:>8} | {interval_ms:>11.0f} "
                    f"| {plain:>14.3f} | {r['hit_rate']:>6.3f} | {best:>6.3f} "
                    f"| {recovered:>9} | {r['hit_rate'] / best:>16.3f} "
                    f"| {r['sends_per_s'] / num_gateways:>23.1f} "
                    f"| {r['us_per_datagram']:>15.0f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
