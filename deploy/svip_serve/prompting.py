"""A request's prompt as token ids: completions encode like `svip generate`, chats go through the
tokenizer's own chat template (a 400 naming the model when it has none)."""

from __future__ import annotations

from svip_common.models import encode
from svip_serve.protocol import ApiRequest, bad


def prompt_ids(tokenizer, req: ApiRequest, model_name: str, max_chars: int | None = None) -> tuple[int, ...]:
    """max_chars: a chat whose rendered text is longer is a 400 before it is tokenized."""
    if req.kind == "completion":
        return encode(tokenizer, req.prompt)
    tools = None if req.tools is None else req.tools.tools
    return chat_prompt_ids(tokenizer, req.messages, model_name, tools, max_chars)


def chat_prompt_ids(tokenizer, messages: list[dict], model_name: str, tools: list[dict] | None = None,
                    max_chars: int | None = None) -> tuple[int, ...]:
    """tools: the request's function definitions, which the template renders where it knows how;
    max_chars: the rendered text's bound, checked before tokenizing (rendering is cheap, tokenizing
    a text far past the context only holds the tokenizer thread: review M-3)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad(f"the model {model_name!r} has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own checks (jinja raise_exception) name the problem
        raise bad(f"the chat template rejected the messages: {exc}", "messages") from None
    if max_chars is not None and len(text) > max_chars:
        raise bad(f"the messages render to {len(text)} characters, far more than fits the model's context",
                  "messages")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template placed every special token
    if not ids:
        raise bad("the messages render to an empty prompt", "messages")
    return tuple(ids)
