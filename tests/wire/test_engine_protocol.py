"""wire.engine_protocol: the bytes of each gateway <-> engine message are
pinned (a field's position is its identity on the wire), both socket specs
accept what the other side sends, and the module imports no engine code."""

import subprocess
import sys

import msgspec
import pytest

from tandem.wire.engine_protocol import (
    ENGINE_INPUT,
    GATEWAY_OUTPUT,
    EngineAbort,
    EngineHeartbeat,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    Logprobs,
    RequestTimings,
    SamplingParams,
    SchedulerStats,
    StructuredOutputsParams,
    UtilityCall,
    UtilityResult,
)

SAMPLES = {
    "request": EngineRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(
            max_tokens=5,
            temperature=0.5,
            top_k=3,
            seed=7,
            stop_token_ids=[2],
            logprobs=1,
            logit_bias={5: -1.5},
            bad_words_token_ids=[[4, 5]],
            num_penalty_prompt_tokens=2,
            prompt_logprobs=0,
        ),
        arrival_time=1.5,
        priority=2,
        cache_salt="s",
        kv_transfer_params={"do_remote_decode": True},
        n=2,
        gateway=1764000000123456789,
    ),
    "request_defaults": EngineRequest("r2", [9], SamplingParams()),
    "request_structured": EngineRequest(
        "r3", [9], SamplingParams(structured_outputs=StructuredOutputsParams("regex", "[ab]+"))
    ),
    "abort": EngineAbort(["a", "b"]),
    "utility_call": UtilityCall(3, "stats", [1, "x"]),
    "utility_result": UtilityResult(3, {"k": 1}),
    "utility_error": UtilityResult(4, error="boom"),
    "outputs": EngineOutputs(
        "e0",
        [
            EngineOutput(
                "r1",
                [7, 8],
                [Logprobs(7, -0.1, [7, 9], [-0.1, -2.0], 1)],
                None,
                FinishReason.LENGTH,
                2,
                None,
                3,
                {"x": 1},
                1,
                RequestTimings("e0", 1, "decode", 0.5, 0.1, 0.2, num_kv_blocks=3),
            ),
            EngineOutput("r2", error="bad", finish_reason=FinishReason.ERROR),
        ],
        12.25,
        SchedulerStats(1, 2, 3, 0.5, 4, 5, 6, 7, 8, 9),
    ),
    "heartbeat": EngineHeartbeat("e0", 2, 17),
}

# msgspec.msgpack.encode of SAMPLES, taken from the messages' previous homes
# (scheduler/messages.py, workers/engine_core.py) before they moved here. Updated on
# purpose since: the requests' SamplingParams grew an 18th element, structured_outputs
# (issue #27); EngineRequest.gateway was appended (issue #29: array_like encodes every
# field, and a message without it decodes to gateway=0, the default gateway);
# SchedulerStats gained four spec_decode_* counters (issue #26: the stats array grew from
# 10 to 14 entries).
GOLDEN_HEX = {
    "request": "99a2723193010203dc00120500cb3fe000000000000003cb3ff00000000000000791"
    "02c201cb0000000000000000cb0000000000000000cb3ff0000000000000cb00000000000000008105cbbf"
    "f8000000000000919204050200c0cb3ff800000000000002a17381b0646f5f72656d6f74655f6465636f64"
    "65c302cf187afca76f25cd15",  # + gateway (issue #29)
    "request_defaults": "99a272329109dc00121000cb3ff000000000000000cb3ff000000000000"
    "0c090c2c0cb0000000000000000cb0000000000000000cb3ff0000000000000cb0000000000000000c090f"
    "fc0c0cb000000000000000000c0c00100",
    "request_structured": "99a272339109dc00121000cb3ff000000000000000cb3ff0000000000"
    "000c090c2c0cb0000000000000000cb0000000000000000cb3ff0000000000000cb0000000000000000c09"
    "0ffc092a57265676578a55b61625d2bcb000000000000000000c0c00100",
    "abort": "9192a161a162",
    "utility_call": "9303a573746174739201a178",
    "utility_result": "930381a16b01c0",
    "utility_error": "9304c0a4626f6f6d",
    "outputs": "94a26530929ba27231920708919507cbbfb999999999999a92070992cbbfb999999999999acbc000"
    "00000000000001c00102c00381a17801019ca2653001a66465636f6465cb3fe0000000000000cb3fb99999"
    "9999999acb3fc999999999999acbbff0000000000000cbbff0000000000000030000009ba2723290c0c003"
    "c0a362616400c000c0cb40288000000000009e010203cb3fe000000000000004050607080900000090",
    "heartbeat": "93a265300211",
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_wire_bytes_unchanged(name):
    assert msgspec.msgpack.encode(SAMPLES[name]).hex() == GOLDEN_HEX[name]
    decoded = msgspec.msgpack.decode(bytes.fromhex(GOLDEN_HEX[name]), type=type(SAMPLES[name]))
    assert decoded == SAMPLES[name]


@pytest.mark.parametrize(
    "spec, kind, name",
    [
        (ENGINE_INPUT, b"R", "request"),
        (ENGINE_INPUT, b"A", "abort"),
        (ENGINE_INPUT, b"U", "utility_call"),
        (GATEWAY_OUTPUT, b"O", "outputs"),
        (GATEWAY_OUTPUT, b"U", "utility_result"),
        (GATEWAY_OUTPUT, b"H", "heartbeat"),
    ],
)
def test_socket_specs_accept_their_messages(spec, kind, name):
    msg = SAMPLES[name]
    assert spec.decode([kind, msgspec.msgpack.encode(msg)]) == (kind, msg)


def test_socket_names_and_caps():
    assert (ENGINE_INPUT.socket, ENGINE_INPUT.max_frame_bytes) == ("engine_input", 64 << 20)
    assert (GATEWAY_OUTPUT.socket, GATEWAY_OUTPUT.max_frame_bytes) == ("gateway_output", 64 << 20)


def test_protocol_imports_no_engine_code():
    """What the gateway imports to talk to engines loads no torch, numpy or
    engine package (a fresh interpreter: this one has them loaded)."""
    code = (
        "import sys, tandem.wire.engine_protocol, tandem.wire.frames, tandem.wire.auth; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') "
        "or (m.startswith('tandem.') and not m.startswith('tandem.wire'))); "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
