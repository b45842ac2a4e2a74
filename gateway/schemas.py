"""Request and response bodies of the OpenAI-compatible API (pydantic; they drive /openapi.json).

Requests accept what the official `openai` SDK sends; fields it may send that this server cannot
honour are declared so they can be refused with a clear 400 instead of silently ignored. Unknown
fields are ignored, as OpenAI does. maskwire extensions (sent with `extra_body`) are marked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------------------------
# Shared pieces


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Request):
    include_usage: bool | None = Field(
        None, description="Send a last chunk with `usage` (and empty `choices`) before `[DONE]`."
    )


class JsonSchemaSpec(_Request):
    name: str = Field(..., max_length=64, description="Name of the schema (not used for decoding).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON Schema the output must validate against."
    )
    strict: bool | None = Field(
        None,
        description="When true, objects that do not say `additionalProperties` get none "
        "(OpenAI's strict mode).",
    )


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StructuredOutputs(_Request):
    """maskwire/vLLM extension (`extra_body={"structured_outputs": {...}}`): exactly one kind."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON Schema (object or JSON text)."
    )
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these.")
    grammar: str | None = Field(
        None,
        description="A context-free grammar: GBNF (rules with `::=`, start rule `root`) or "
        "Lark in llguidance's dialect (start rule `start`).",
    )
    json_object: bool | None = Field(None, description="Any JSON object.")
    whitespace_flexible: bool | None = Field(
        None,
        description="maskwire: allow free JSON whitespace (default false: compact separators).",
    )


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(
        ..., description="Completion tokens of the thinking section, up to its end marker."
    )


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(
        default_factory=PromptTokensDetails,
        description="`cached_tokens`: prompt tokens the worker's prefix cache held already.",
    )
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None,
        description="Set for models that think (their template has a thinking section).",
    )


# ---------------------------------------------------------------------------------------------
# Chat completions


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class OtherContentPart(_Request):
    """Any other content part (images, audio...): accepted by the schema, refused with a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


ContentPart = TextContentPart | OtherContentPart


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(..., description="The arguments as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Calls made by an assistant turn.")
    tool_call_id: str | None = Field(None, description="For `tool` messages: the call answered.")
    reasoning_content: str | None = Field(
        None, description="An assistant turn's thinking, for templates that render it."
    )


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object (default: any object)."
    )
    strict: bool | None = Field(
        None, description="Objects without `additionalProperties` get none (OpenAI strict)."
    )


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingFields(_Request):
    """Fields shared by both completion endpoints."""

    model: str = Field(..., description="The served model's id (see `GET /v1/models`).")
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(
        None, ge=1, description="Choices to generate (default 1; at most the gateway's --max-n)."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings; generation stops before them."
    )
    seed: int | None = Field(None, description="Sampling seed (any integer; taken modulo 2**64).")
    logprobs: Any = Field(
        None,
        description="Chat: true for the tokens' log-probabilities. Completions: the number of "
        "alternatives per token (0-20), 0 for the tokens' own only.",
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted once from every token already in the output."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted per occurrence in the output so far."
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100] added to its logit; at most "
        "300. A token the constraint forbids stays forbidden.",
    )
    user: str | None = Field(None, description="Ignored.")
    response_format: ResponseFormat | None = None
    # Extensions (vLLM-compatible, via `extra_body`).
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension: constrain the output with a regex, choice or grammar."
    )
    top_k: int | None = Field(None, ge=0, description="Extension: keep the k most likely tokens.")
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=2,
        description="Extension: logits of tokens in the prompt or output are divided by it "
        "(positive ones) or multiplied (negative ones); 1 is off.",
    )
    logprobs_mode: Literal["processed", "raw"] | None = Field(
        None,
        description="maskwire: `processed` (default) reports the distribution the token was "
        "drawn from (penalties, bias, grammar mask, temperature); `raw` the model's own.",
    )
    ignore_eos: bool | None = Field(None, description="Extension: keep going past end-of-text.")
    cache_salt: str | None = Field(
        None,
        max_length=200,
        description="Extension (vLLM's): the worker's prefix cache reuses only prompts cached by "
        "requests with the same salt (with API keys, only within one key).",
    )
    speculative: bool | None = Field(
        None,
        description="maskwire: false opts this request out of speculative decoding (the worker's "
        "--speculative, on by default on a CPU; greedy outputs are the same either way).",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (legacy vLLM).")
    guided_regex: str | None = Field(None, description="Extension (legacy vLLM).")
    guided_choice: list[str] | None = Field(None, description="Extension (legacy vLLM).")
    guided_grammar: str | None = Field(None, description="Extension (legacy vLLM).")
    schema_mode: Literal["strict", "complete"] | None = Field(
        None,
        description="maskwire: JSON schema keywords the grammar cannot enforce as written are "
        "refused (`strict`) or rewritten / checked on the output (`complete`, the default).",
    )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of the next field.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (default: up to the context limit)."
    )
    top_logprobs: int | None = Field(
        None, description="Alternatives per token (0-20); needs `logprobs: true`."
    )
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description='Default "auto" when `tools` are given, else "none".'
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Default true: the model may return several calls."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: extra variables for the chat template."
    )


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(
        default=None,
        description="The model's thinking (models whose template has a thinking section).",
    )
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str = Field(..., description="The token's text (`bytes:\\xNN...` if not UTF-8 alone).")
    logprob: float
    bytes: list[int] = Field(..., description="The token's bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    forced: bool = Field(
        False, description="maskwire: the grammar forced this token (not sampled; logprob 0)."
    )


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = Field(
        None, description="With `logprobs`: the tokens this chunk adds."
    )


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------
# Legacy completions


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="One prompt: text, or token ids (a list of one is accepted)."
    )
    max_tokens: int | None = Field(16, ge=1, description="Most tokens to generate (default 16).")
    echo: bool | None = Field(None, description="Return the prompt before the completion.")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, ge=1, description="Only 1 is supported.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    forced: list[bool] = Field(
        ..., description="maskwire: per token, whether the grammar forced it (logprob 0)."
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------
# Models, health, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "maskwire"
    max_model_len: int | None = Field(None, description="Longest prompt + completion in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class WorkerHealth(BaseModel):
    address: str
    healthy: bool
    in_flight: int
    model: str | None = None


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    workers: list[WorkerHealth]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
