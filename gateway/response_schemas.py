"""Bodies of the Responses API (`POST /v1/responses`), as the official `openai` SDK sends and reads
them. Requests are loose where OpenAI's are (input items, tools, tool_choice): what this server
cannot honour is refused with a 400 naming the field (`gateway.responses`), not a 422."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.schemas import StructuredOutputs, _Request

# ---------------------------------------------------------------------------------------------
# Request


class InputContentPart(_Request):
    """`input_text` / `output_text` (and `reasoning_text` in a reasoning item) carry text; other
    parts (images, files, audio) are refused."""

    type: str
    text: str | None = None


class InputItem(_Request):
    """One `input` item: a message (`type` absent or `message`), a `function_call`, a
    `function_call_output` or a `reasoning` item; other types are refused."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    summary: list[InputContentPart] | None = None


class ResponsesTool(_Request):
    """A function tool, flat (`name` and `parameters` at the top); other tool types are refused."""

    type: str
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Default true, as in OpenAI's Responses API.")


class TextFormat(_Request):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name",
    "schema", "strict"}`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponseCreateRequest(_Request):
    model: str = Field(..., description="The served model's id (see `GET /v1/models`).")
    input: str | list[InputItem] = Field(..., description="A user message, or input items.")
    instructions: str | None = Field(None, description="A system message placed first.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (default: up to the context limit)."
    )
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = Field(
        None, description="Accepted and ignored: a model thinks when its chat template says so."
    )
    # Refused when set (this server keeps no state and computes no logprobs yet).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    include: list[str] | None = None
    # Ignored, as OpenAI's bookkeeping fields.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extensions (`extra_body`), as on chat completions.
    seed: int | None = Field(None, description="Extension: sampling seed.")
    cache_salt: str | None = Field(
        None, max_length=200, description="Extension: as on chat completions."
    )
    top_k: int | None = Field(None, ge=0, description="Extension: keep the k most likely tokens.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension: constrain the output with a regex, choice or grammar."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: extra variables for the chat template."
    )


# ---------------------------------------------------------------------------------------------
# Response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response; also the body of the stream's lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    reasoning: dict[str, Any] | None = None
    previous_response_id: None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
