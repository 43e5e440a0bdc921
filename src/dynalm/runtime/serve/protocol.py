"""The wire format of the HTTP API: pydantic models mirroring OpenAI's.

Requests validate types and ranges here, so a bad parameter is a 400 naming the field
before anything reaches the engine. Unknown request fields are ignored, as OpenAI does, so
clients that send newer parameters keep working; OpenAI's own fields that DynaLM does not
implement are refused by name instead (`_unsupported`), since ignoring them would silently
answer another question. Responses are the shapes the official ``openai`` client parses.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from dynalm.errors import InvalidRequest
from dynalm.flags import MAX_DURATION_S, parse_duration
from dynalm.runtime.serve.structured import ConstraintFields
from dynalm.runtime.serve.tools import ToolCall, ToolFields

# ---------------------------------------------------------------- requests

MAX_SEED = 2**64 - 1
MAX_TOKEN_ID = 10**9 - 1  # far above any vocabulary; the server checks its own
MAX_LOGIT_BIAS = 1024  # entries
# characters of one stop string: each is matched against every token's text, and the
# decoder holds back as much text as the longest could need
MAX_STOP_CHARS = 1000


def clip(text: str, limit: int = 40) -> str:
    """``text`` shortened for an error message (a hostile value may be megabytes long)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_KEEP_ALIVE_SCHEMA = {
    "anyOf": [{"type": "number"}, {"type": "string"}, {"type": "null"}],
    "description": 'Seconds, or a duration such as "10m" (0: unload after this request, '
    "negative: keep loaded).",
}


def keep_alive_seconds(v: Any) -> float | None:
    """A request's ``keep_alive`` (a number of seconds or a duration string) in seconds, as
    ``--keep-alive`` parses it."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError('must be a number of seconds or a duration such as "10m"')
    if not isinstance(v, str):  # a JSON number (1e300 is no ASCII duration, but is "forever")
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return -1.0 if v < 0 or v > MAX_DURATION_S else float(v)
    try:
        return parse_duration(v, "")
    except InvalidRequest as e:
        raise ValueError(str(e)) from None


def _unsupported(*neutral: Any) -> Any:
    """A field of OpenAI's API that DynaLM does not implement: accepted (and ignored) only at
    a value that asks for nothing, else a 400 naming it."""

    def check(v: Any, info: ValidationInfo) -> Any:
        if not any(v == x and type(v) is type(x) for x in neutral):  # true is no 1 here
            allowed = " or ".join(json.dumps(x) for x in neutral)
            raise ValueError(f"not supported (leave {info.field_name} out or send {allowed})")
        return v

    schema = {"enum": list(neutral), "description": "Not supported: only these values."}
    return Annotated[Any, BeforeValidator(check), WithJsonSchema(schema)]


class _Request(BaseModel):
    """Every part of a request body is validated as strictly as the OpenAPI document says:
    no value is coerced into another type (``"1"`` is no integer, ``0`` no ``false``), and
    numbers must be finite (``Infinity`` and ``NaN`` parse as JSON but mean nothing here)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    # an assistant's earlier reasoning (vLLM's and llama.cpp's name), for templates that show it
    reasoning_content: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="wrap")
    @classmethod
    def _text_only(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            content = handler(v)
        except ValidationError:
            raise ValueError(
                'must be a string, null or a list of parts {"type": "text", "text": "..."}'
            ) from None
        for part in content if isinstance(content, list) else []:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type '{clip(part.type)}' are not supported")
        return content

    def text(self) -> str:
        """The message's text (the text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,9}")


# The sampling parameters' types and ranges, shared by every API that takes them (OpenAI's
# fields here, Ollama's ``options``): one place says what the sampler accepts.
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0)]
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # presence and frequency
# beyond these, logits overflow (below) or every repeated token is simply banned (above)
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=10)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
StopStrings = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=4)
]


class SamplingRequest(_Request, ConstraintFields):
    """What chat and completion requests share: the model and the sampling parameters.

    Defaults follow OpenAI (temperature 1, nucleus off), not ``dynalm run``'s.
    """

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed | None = None
    stop: StopStrings = []
    n: Annotated[int, Field(ge=1, le=16)] = 1
    # bounded: the sampler applies every entry to every token of the answer
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=f"^{_TOKEN_ID_KEY.pattern}$")],
                Annotated[float, Field(ge=-100, le=100)],
            ],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens past end-of-turn tokens
    # Ollama's, here too: how long the model stays loaded after this request, in seconds or
    # as "10m" (0: unloaded after it, negative: kept); None: the server's --keep-alive
    keep_alive: Annotated[float | None, WithJsonSchema(_KEEP_ALIVE_SCHEMA)] = None

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return keep_alive_seconds(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else [] if v is None else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        # strictly ASCII decimal token ids: "²", "--5" or 5,000 digits are not
        for key in v if isinstance(v, dict) else {}:
            if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key)):
                raise ValueError(f"keys must be token ids (0 to {MAX_TOKEN_ID}), got {clip(key)!r}")
        return v

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_logprob_count(self) -> int | None:
        """How many alternatives per token to report; None when logprobs are off."""
        raise NotImplementedError

    @property
    def prompt_logprob_count(self) -> int | None:
        """How many alternatives per prompt token to score; None: the prompt is not scored."""
        return None


class ChatCompletionRequest(SamplingRequest, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    functions: _unsupported(None, []) = None
    function_call: _unsupported(None, "none") = None
    audio: _unsupported(None) = None
    modalities: _unsupported(None, ["text"]) = None
    prediction: _unsupported(None) = None
    web_search_options: _unsupported(None) = None
    prompt_logprobs: _unsupported(None) = None  # /v1/completions scores prompts
    # for templates that read it (gpt-oss's "Reasoning: high"); others ignore it
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        # max_completion_tokens is the newer name of max_tokens
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]
_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of such lists"


class CompletionRequest(SamplingRequest):
    # a string, a batch of strings, one prompt of token ids, or a batch of those
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # the prompt before the answer (and with logprobs, its tokens' log-probs, first null)
    echo: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # vLLM's
    suffix: _unsupported(None, "") = None
    best_of: _unsupported(None, 1) = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(v)
        except ValidationError:
            raise ValueError(
                f"must be {_PROMPT_FORMS} (not empty; token ids 0 to {MAX_TOKEN_ID})"
            ) from None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, however it was written."""
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if single else list(self.prompt)  # type: ignore[list-item]

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((w for w in wanted if w is not None), default=None)


class TokenizeRequest(_Request):
    """Either ``prompt`` (tokenised as a completion prompt) or ``messages`` (chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]


# ---------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    # with echo, the prompt's first token has no log-prob: null (nothing precedes it)
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # reasoning apart from the answer (harmony's analysis channel), in the field vLLM's and
    # llama.cpp's servers use
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": ...} first, then {"content": ...} or {"tool_calls": [...]}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token (the first null), its own and the most likely tokens
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dynalm"
    # extensions: a model of the store is listed whether it is loaded or not
    loaded: bool = True
    max_model_len: int | None = None  # the context it was loaded with (None: not loaded)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()
