"""Per-request generation: a decoded request becomes a ``Job`` and its steps.

    prepare_completion / prepare_chat   validate (protocol, edge), tokenize,
                                        build the EngineRequest and formatters
    start -> RequestRun                 backend.generate() -> detokenize +
                                        stop strings (``job.output_step``) ->
                                        text or a ``Step`` per output;
                                        metrics and the request's record
                                        (``request_run.py``)

``Gateway`` knows no routes and writes no bytes: a prepared job is answered
by ``responses.GenerationResponse``, which drives the job's ``RequestRun``. A matched
stop string, or a consumer that stops early (disconnect, deadline), aborts
the request on the backend.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

import msgspec
from starlette.responses import Response

from tandem.cluster.gateway import formatting, protocol
from tandem.cluster.gateway.api.config import ApiConfig, ServedModels
from tandem.cluster.gateway.backend import Backend
from tandem.cluster.gateway.edge import sampling as edge_sampling
from tandem.cluster.gateway.edge import structured as edge_structured
from tandem.cluster.gateway.edge.limits import GatewayLimits, RequestSlots
from tandem.cluster.gateway.edge.tokenizer_pool import TokenizerPool, chat_text_len
from tandem.cluster.gateway.job import Job
from tandem.cluster.gateway.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from tandem.cluster.gateway.request_run import RequestRun
from tandem.cluster.gateway.responses import GenerationResponse
from tandem.cluster.gateway.tools.formatting import ToolChatFormatter
from tandem.cluster.gateway.tools.request import plan_tools
from tandem.cluster.observability.logging_setup import REQUEST_ID
from tandem.cluster.observability.metrics import GatewayMetrics
from tandem.cluster.observability.tracing.observer import RequestObserver, Tracer
from tandem.cluster.observability.tracing.phase_metrics import RequestPhaseMetrics
from tandem.cluster.observability.tracing.record import TRACEPARENT, RequestRecord
from tandem.wire.engine_protocol import EngineRequest, SamplingParams


class Gateway:
    """Request preparation and the generation loop, independent of routes."""

    def __init__(
        self,
        backend: Backend,
        metrics: GatewayMetrics,
        limits: GatewayLimits | None = None,
        api: ApiConfig | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.backend = backend
        self.api = api = api or ApiConfig()
        self.models = ServedModels(api.served_model_names, backend.model_name)
        self.metrics = metrics
        self.observer = RequestObserver(RequestPhaseMetrics(), tracer)
        self.limits = limits = limits or GatewayLimits()
        self.slots = RequestSlots(limits.max_num_requests, limits.retry_after_s)
        self.tokenizer = backend.tokenizer
        self.tokenizer_pool = TokenizerPool(backend.tokenizer, limits.tokenizer_workers)
        self.vocab_size = len(backend.tokenizer)
        self.started_at = int(time.time())
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- preparation (raises ProtocolError) ----

    async def prepare_completion(self, req: CompletionRequest, arrival_s: float) -> Response:
        model = self.models.resolve(req.model)
        protocol.validate_common(req, model)
        prompt = protocol.completion_prompt(req)
        edge_sampling.check_num_logprobs(req.logprobs, "logprobs", self.limits.max_logprobs)
        if isinstance(prompt, str):
            self.tokenizer_pool.check_text_len(len(prompt), self.backend.max_model_len, "prompt")
            prompt_ids = await self.tokenizer_pool.encode(prompt)
        else:
            prompt_ids = self._check_token_ids(prompt)
        self._check_prompt_len(prompt_ids)
        self.api.generation_defaults.apply(req, self.backend.max_model_len - len(prompt_ids))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self._check_total_len(prompt_ids, max_tokens, "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        formatter = formatting.CompletionFormatter(
            request_id, model, int(time.time()), req.logprobs, self.token_text
        )
        params = protocol.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        spec, _ = edge_structured.request_spec(req)
        if spec is not None:
            params = msgspec.structs.replace(params, structured_outputs=spec)
        echo_text = None
        if req.echo:
            echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            if req.logprobs is not None:  # the echoed tokens carry logprobs too
                num_top = max(req.prompt_logprobs or 0, req.logprobs)
                params = msgspec.structs.replace(params, prompt_logprobs=num_top)
        return self._response(req, prompt_ids, params, formatter, arrival_s, echo_text)

    async def prepare_chat(self, req: ChatCompletionRequest, arrival_s: float) -> Response:
        model = self.models.resolve(req.model)
        protocol.validate_common(req, model)
        protocol.check_chat_fields(req)
        spec, spec_field = edge_structured.request_spec(req)
        plan = plan_tools(req, self.api.enable_auto_tool_choice, self.api.tool_call_parser)
        if plan is not None and plan.spec is not None:
            if spec is not None:
                raise ProtocolError(
                    f"{spec_field} cannot be combined with tool_choice {plan.mode!r}.",
                    param=spec_field,
                )
            spec = plan.spec
        num_logprobs = protocol.chat_logprobs(req)
        edge_sampling.check_num_logprobs(req.top_logprobs, "top_logprobs", self.limits.max_logprobs)
        num_chars = chat_text_len(req.messages)
        self.tokenizer_pool.check_text_len(num_chars, self.backend.max_model_len, "messages")
        try:
            prompt_ids = await self.tokenizer_pool.chat(
                req.messages, req.add_generation_prompt, plan.template_tools if plan else None
            )
        except ValueError as exc:
            raise ProtocolError(str(exc), param="messages") from None
        self._check_prompt_len(prompt_ids, param="messages")
        self.api.generation_defaults.apply(req, self.backend.max_model_len - len(prompt_ids))
        max_tokens = req.max_completion_tokens or req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if max_tokens is None:
            max_tokens = self.backend.max_model_len - len(prompt_ids)
        else:
            self._check_total_len(prompt_ids, max_tokens, param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        args = (request_id, model, int(time.time()), num_logprobs, self.token_text)
        if plan is not None and plan.mode != "none":
            formatter = ToolChatFormatter(*args, plan=plan)
        else:
            formatter = formatting.ChatFormatter(*args)
        params = protocol.sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs)
        if spec is not None:
            params = msgspec.structs.replace(params, structured_outputs=spec)
        return self._response(req, prompt_ids, params, formatter, arrival_s)

    def _response(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        formatter: formatting.CompletionFormatter | formatting.ChatFormatter,
        arrival_s: float,
        echo_text: str | None = None,
    ) -> Response:
        self._check_token_ids(params.stop_token_ids, param="stop_token_ids")
        max_logprobs = self.limits.max_logprobs
        edge_sampling.check_num_logprobs(req.prompt_logprobs, "prompt_logprobs", max_logprobs)
        params = edge_sampling.with_token_fields(params, req, self.tokenizer, self.vocab_size)
        deadline_s = None
        if self.limits.request_timeout_s:
            elapsed_s = time.perf_counter() - arrival_s
            deadline_s = (
                asyncio.get_running_loop().time() + self.limits.request_timeout_s - elapsed_s
            )
        REQUEST_ID.set(formatter.request_id)  # every later log line of this request
        chat = isinstance(formatter, formatting.ChatFormatter)
        record = RequestRecord(
            formatter.request_id,
            "chat.completions" if chat else "completions",
            arrival_s,
            time.time_ns() - int((time.perf_counter() - arrival_s) * 1e9),
            len(prompt_ids),
            traceparent=TRACEPARENT.get(),
        )
        job = Job(
            engine_request=EngineRequest(
                formatter.request_id,
                prompt_ids,
                params,
                arrival_time=time.time(),
                cache_salt=req.cache_salt,
                priority=req.priority,
                n=req.n,
            ),
            formatter=formatter,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            stop=protocol.stop_strings(req),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            arrival_s=arrival_s,
            deadline_s=deadline_s,
            formatters=[formatter, *(formatter.for_choice(i) for i in range(1, req.n))],
            echo_text=echo_text,
            echo_logprobs=echo_text is not None and params.logprobs is not None,
            want_prompt_logprobs=req.prompt_logprobs is not None,
            record=record,
        )
        return GenerationResponse(self, job)

    def _check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ProtocolError(
                    f"Token id {token_id} is out of range [0, {self.vocab_size}).", param=param
                )
        return token_ids

    def _check_prompt_len(self, prompt_ids: list[int], param: str = "prompt") -> None:
        if not prompt_ids:
            raise ProtocolError("The prompt is empty.", param=param)
        if len(prompt_ids) >= self.backend.max_model_len:
            raise ProtocolError(
                f"The prompt has {len(prompt_ids)} tokens; the model's context length is "
                f"{self.backend.max_model_len}, which leaves no room to generate.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_total_len(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        if len(prompt_ids) + max_tokens > self.backend.max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {self.backend.max_model_len} tokens; "
                f"the request asks for {len(prompt_ids)} prompt + {max_tokens} output tokens.",
                param=param,
                code="context_length_exceeded",
            )

    # ---- generation ----

    def start(self, job: Job) -> RequestRun:
        """Open ``job``'s request on the backend; the caller pulls ``run.outputs``
        and must ``close()`` the run (``request_run.py``). The backend raises
        ``BackendUnavailable`` at the first pull, before any output."""
        return RequestRun(self, job)
