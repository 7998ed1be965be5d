"""Engines under hostile input (issue 11): a prefill and a decode EngineCore
in their own processes with CURVE on every socket, as ``tandem serve`` runs
them. Malformed messages on the engine input and on P's side channel are
dropped and counted; peers without the cluster secret are refused and
counted; after each scenario a real P->D handoff gives the single-engine
tokens, check_integrity() passes and neither process restarted."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tandem.kvtransfer.side_channel import HandshakeError, Notification, fetch_handshake
from tandem.wire.auth import PlaneAuth, generate_secret
from tandem.wire.engine_protocol import EngineAbort, EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import handoff

pytestmark = pytest.mark.slow

BASE = dict(model="tiny", block_size=16, num_kv_blocks=64, max_model_len=256)
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(20, 60))


@pytest.fixture(scope="module")
def pd():
    h = Harness()
    try:
        common = dict(BASE, kv_connector="nixl")
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start("D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=10.0, **common))
        pids = {n: e.proc.pid for n, e in h.engines.items()}
        yield h
        assert {n: e.proc.pid for n, e in h.engines.items()} == pids
    finally:
        h.close()


@pytest.fixture(scope="module")
def expected():
    (out,) = LLM(EngineConfig.from_flat(**BASE)).generate(
        prompt_token_ids=[PROMPT], sampling_params=SP
    )
    return out.token_ids


def wire(h: Harness, name: str) -> dict:
    return msgspec.structs.asdict(h.stats(name).wire)


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def still_serving(h: Harness, rid: str, expected: list[int]) -> None:
    toks, last, _ = handoff(h, rid, PROMPT, SP)
    assert toks == expected and last.finish_reason == FinishReason.LENGTH
    for name, e in h.engines.items():
        assert e.proc.is_alive(), name
        h.wait_idle(name)  # check_integrity() included


def member_socket(h: Harness, kind: int, addr: str) -> zmq.Socket:
    sock = h.ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    h.auth.client(sock)
    sock.connect(addr)
    return sock


def test_malformed_engine_input_is_dropped_and_counted(pd, expected):
    enc = msgspec.msgpack.encode
    malformed = [
        [b"R"],  # one frame
        [b"R", enc(EngineRequest("x", [1], SP)), b"extra"],  # three frames
        [b"R", b"\xc1\xc1 not msgpack"],
        [b"R", enc(EngineAbort(["x"]))],  # valid msgpack, wrong type for R
        [b"A", enc({"request_ids": 5})],
        [b"U", enc([1, 2, 3, 4, 5])],
        [b"Q", enc(EngineRequest("x", [1], SP))],  # unknown kind
        [b"R", b"\x00" * (64 * 1024 * 1024 + 1)],  # over the 64 MiB cap
    ]
    sock = member_socket(pd, zmq.PUSH, pd.engines["D"].input_addr)
    try:
        for frames in malformed:
            sock.send_multipart(frames)
        wait_for(lambda: wire(pd, "D")["malformed_frames"].get("engine_input") == len(malformed))
    finally:
        sock.close()
    still_serving(pd, "after-malformed-input", expected)
    assert wire(pd, "P")["malformed_frames"] == {}


def test_malformed_side_channel_messages_are_dropped_and_counted(pd, expected):
    host, port = pd.call("P", "kv_transfer_address")
    sock = member_socket(pd, zmq.DEALER, f"tcp://{host}:{port}")
    try:
        sock.send_multipart([b"one frame"])
        sock.send_multipart([b"", b"\xc1 not msgpack"])
        sock.send_multipart([b"", msgspec.msgpack.encode(["notify", 1, 2])])
        sock.send_multipart([b"", b"\x00" * (1024 * 1024 + 1)])
        wait_for(lambda: wire(pd, "P")["malformed_frames"].get("kv_side_channel") == 4)
    finally:
        sock.close()
    still_serving(pd, "after-malformed-side-channel", expected)


def test_peers_without_the_secret_are_refused(pd, expected):
    # 1. cannot send requests to an engine
    intruder_ctx = zmq.Context()
    try:
        push = intruder_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        PlaneAuth(intruder_ctx, generate_secret()).client(push)
        push.connect(pd.engines["D"].input_addr)
        push.send_multipart([b"R", msgspec.msgpack.encode(EngineRequest("intruder", PROMPT, SP))])
        wait_for(lambda: wire(pd, "D")["auth_failures"].get("engine_input", 0) >= 1)
        push.close()
        # 2. cannot handshake with P's side channel, so never sees its agent metadata
        host, port = pd.call("P", "kv_transfer_address")
        for secret in (None, generate_secret()):
            with pytest.raises(HandshakeError, match="no handshake reply"):
                fetch_handshake(
                    intruder_ctx, host, port, "evil", 0.5, auth=PlaneAuth(intruder_ctx, secret)
                )
        wait_for(lambda: wire(pd, "P")["auth_failures"].get("kv_side_channel", 0) >= 2)
        # 3. cannot push outputs to the harness's output socket (the gateway's role)
        fake = intruder_ctx.socket(zmq.PUSH)
        fake.setsockopt(zmq.LINGER, 0)
        fake.connect(pd.output_addr)
        fake.send_multipart([b"O", b"forged"])
        wait_for(lambda: pd.auth.failures().get("gateway_output", 0) >= 1)
        fake.close()
        # 4. a notification from outside never frees P's held blocks early
        notify = intruder_ctx.socket(zmq.DEALER)
        notify.setsockopt(zmq.LINGER, 0)
        notify.connect(f"tcp://{host}:{port}")
        notify.send_multipart([b"", msgspec.msgpack.encode(Notification("P", 0, "done", "x"))])
        notify.close()
    finally:
        intruder_ctx.term()
    still_serving(pd, "after-intruders", expected)
    assert "intruder" not in pd.outputs
