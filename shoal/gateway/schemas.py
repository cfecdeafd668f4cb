"""Request bodies of the OpenAI API subset the gateway serves, validated strictly enough to answer
a malformed request with OpenAI's error shape (400, ``param`` naming the field) instead of a 422."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.gateway.engine import GatewayError, Sampling

__all__ = ["ChatRequest", "CompletionRequest", "parse"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields we do not act on (user, logit_bias, ...) are accepted

    model: str
    stream: bool = False
    stream_options: dict | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # one choice per request

    def sampling(self, max_tokens: int) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise GatewayError(400, "stop takes at most 4 sequences", param="stop")
        temperature = 1.0 if self.temperature is None else self.temperature
        return Sampling(max_tokens, temperature, self.top_p or 1.0, self.seed, tuple(stop))

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatRequest(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Body):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False  # echo, suffix, best_of and logprobs are not served
    suffix: None = None
    logprobs: None = None

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_input(self) -> str | list[int]:
        return self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) else self.prompt


def parse(raw: bytes, schema: type[_Body]) -> _Body:
    """``raw`` request body -> ``schema``; :class:`GatewayError` (400) names what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "The request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise GatewayError(400, f"Invalid value for '{param}': {first['msg']}", param=param) from None
