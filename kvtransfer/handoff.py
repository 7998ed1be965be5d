"""The two requests of a prefill -> decode handoff, built from the client's one.

    client request (prompt, max_tokens=N)
      -> prefill_request : prompt, max_tokens=1, {do_remote_decode}
      <- P's output      : first token t0 + kv_transfer_params
      -> decode_request  : prompt + [t0], max_tokens=N-1, P's params + {do_remote_prefill}

The gateway's backend, the engine-level tests and benchmarks all use these,
so the handoff has one definition.
"""

from __future__ import annotations

import msgspec

from tandem.wire.engine_protocol import EngineOutput, EngineRequest


def prefill_request(request: EngineRequest) -> EngineRequest:
    """What the prefill engine runs: the prompt and one sampled token."""
    sp = request.sampling_params
    return msgspec.structs.replace(
        request,
        sampling_params=msgspec.structs.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1)),
        kv_transfer_params={"do_remote_decode": True},
    )


def decode_request(request: EngineRequest, first: EngineOutput) -> EngineRequest:
    """What the decode engine runs after P returned ``first``: P's tokens join
    the prompt (never recomputed) and count against max_tokens/min_tokens."""
    sp = request.sampling_params
    n = len(first.new_token_ids)
    params = dict(first.kv_transfer_params or {})
    params["do_remote_prefill"] = True
    params.pop("do_remote_decode", None)
    # P's tokens stay output tokens for the penalties (SamplingParams).
    num_penalty_prompt = sp.num_penalty_prompt_tokens
    if num_penalty_prompt < 0:
        num_penalty_prompt = len(request.prompt_token_ids)
    return msgspec.structs.replace(
        request,
        prompt_token_ids=list(request.prompt_token_ids) + list(first.new_token_ids),
        sampling_params=msgspec.structs.replace(
            sp,
            max_tokens=sp.max_tokens - n,
            min_tokens=max(0, sp.min_tokens - n),
            num_penalty_prompt_tokens=num_penalty_prompt,
            prompt_logprobs=None,  # P computed the prompt and returned them
        ),
        kv_transfer_params=params,
    )
