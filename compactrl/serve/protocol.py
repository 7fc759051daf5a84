"""The OpenAI wire format the server speaks (and vLLM's extensions RL clients rely on), as pydantic
models: what a request may say, checked before any work starts, and the OpenAI-style error body.

Fields OpenAI defines that this server does not implement (penalties, logit bias, structured output,
a forced ``tool_choice``) are accepted only at their neutral value, so a client that sends a default
is served and a client that relies on one is told so, instead of being silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.compaction import StrategyConfig
from compactrl.compaction.evictors import EvictorConfig
from compactrl.serve.tools import template_calls

ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
    """An error the client caused (or must wait out), answered as OpenAI does:
    ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        409: "conflict_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # a streamed call's index, which some clients keep


class Function(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, as the template will see it)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def extra(self) -> dict[str, Any]:
        """The template's fields besides role and content: an assistant message's tool calls, a tool
        message's call id and name."""
        if self.tool_calls:
            return {"tool_calls": template_calls([c.model_dump() for c in self.tool_calls])}
        if self.role == "tool":
            return {
                k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None
            }
        return {}

    @model_validator(mode="after")
    def _supported(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "developer":  # OpenAI's newer name for the system role
            self.role = "system"
        return self


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """What chat and text completions share: sampling, the session, vLLM's token-id extensions."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's extension; 0 or -1: off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # the session: its stream lives across requests (also the X-Session-Id header)
    session_id: str | None = Field(None, min_length=1, max_length=256)
    compaction: Literal["stream", "reprefill"] | None = None
    evictor: EvictorConfig | None = None
    strategy: StrategyConfig | None = None
    # OpenAI fields accepted at their neutral value only
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if self.frequency_penalty or self.presence_penalty or self.logit_bias:
            raise ValueError(
                "frequency_penalty, presence_penalty and logit_bias are not supported: "
                "sampled log-probs must be those of the model the trainer replays"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream = true")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # accepted, not enforced: the model writes as many calls as it writes
    parallel_tool_calls: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # sessions naming one group (a GRPO group's rollouts of one task) read their common first prompt from
    # one stream, forked: its KV computed once (stream sessions without an evictor or tools)
    group: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _chat(self):
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        if not self.add_generation_prompt:
            raise ValueError(
                "add_generation_prompt = false is not supported: a chat completion answers as the assistant"
            )
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_list(self) -> list[dict] | None:
        """The tools as the template gets them (OpenAI's dicts), None when there are none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per element when a batch was sent, else the one."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadWeightsRequest(_Strict):
    path: str = Field(
        description="a model folder (model.safetensors), a checkpoint or run folder (its merged model), "
        "or a LoRA adapter merged over the base weights: a peft folder (adapter_config.json + "
        "adapter_model.safetensors) or compactrl's lora.safetensors"
    )
    keep_kv: bool = Field(
        True,
        description="sessions keep their KV (tokens fed before keep old-weight K/V); "
        "false: every session is recomputed with the new weights",
    )
