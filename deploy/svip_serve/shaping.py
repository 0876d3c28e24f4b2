"""What a deployment allows of a request, and the GenerationRequest it becomes: the model it names,
ignore_eos, max_tokens within the cap, a prompt that can fit the context (checked on its length
before tokenizing, then on its tokens), and the max_tokens a request that names none gets. Runs in
a Serve replica (server.py); every refusal is a 400 or 404 that names the field."""

from __future__ import annotations

from collections.abc import Callable

from svip_common.contracts import GenerationRequest
from svip_common.errors import InvalidRequest
from svip_serve import prompting
from svip_serve.protocol import ApiError, ApiRequest, bad, rendered_chars
from svip_serve.settings import ServeSettings

# a prompt with more characters than this per context position cannot fit: refused before tokenizing
MAX_CHARS_PER_TOKEN = 16


class RequestShaping:
    def __init__(self, settings: ServeSettings, tokenizer, context: int | None, kv_tokens: int | None,
                 resolve: Callable[[GenerationRequest], GenerationRequest]):
        """context: the pair's shorter context (None: unbounded); kv_tokens: a worker's KV pool;
        resolve: the engine's check of a request as it will run."""
        self.settings, self.tokenizer, self.resolve = settings, tokenizer, resolve
        self.context, self.kv_tokens = context, kv_tokens

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.settings.served_name!r}",
                param="model",
                code="model_not_found",
            )

    def check(self, req: ApiRequest) -> None:
        """What this deployment allows, before any tokenizing: ignore_eos, max_tokens within its
        cap, and text so much longer than the context that it cannot fit (tokenizing it would only
        hold the tokenizer thread), every string the chat template renders counted."""
        if req.ignore_eos and not self.settings.allow_ignore_eos:
            raise bad("'ignore_eos' is not allowed on this deployment", "ignore_eos")
        cap = self.settings.max_tokens_cap
        if req.max_tokens is not None and req.max_tokens > cap:
            raise bad(f"'max_tokens' must be at most {cap} on this deployment, got {req.max_tokens}", "max_tokens")
        ctx = self.context
        if ctx is None:
            return
        tools = None if req.tools is None else req.tools.tools
        chars = len(req.prompt) if isinstance(req.prompt, str) else rendered_chars(req.messages or (), tools)
        if chars > ctx * MAX_CHARS_PER_TOKEN:
            raise bad(
                f"the prompt is {chars} characters, far more than fits the model's context of {ctx} tokens",
                "messages" if req.kind == "chat" else "prompt",
            )

    def generation_request(self, req: ApiRequest) -> GenerationRequest:
        """The request tokenized and sized (on the tokenizer's thread)."""
        try:
            most = None if self.context is None else self.context * MAX_CHARS_PER_TOKEN
            prompt_ids = prompting.prompt_ids(self.tokenizer, req, self.settings.served_name, most)
            ctx = self.context
            if ctx is not None and len(prompt_ids) >= ctx:
                raise bad(f"the prompt is {len(prompt_ids)} tokens; the model's context is {ctx} tokens", "prompt")
            max_tokens = req.max_tokens if req.max_tokens is not None else self._default_max_tokens(len(prompt_ids))
            if ctx is not None and len(prompt_ids) + max_tokens > ctx:
                raise bad(
                    f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                    f"context of {ctx} tokens",
                    "max_tokens",
                )
            # max_tokens 0 (echo): the prompt's prefill scores it and settles one token, dropped in the answer
            request = GenerationRequest(prompt_ids, max(max_tokens, 1), req.sampling, req.policy, req.stop_token_ids,
                                        ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                                        prompt_logprobs=req.echo and req.logprobs is not None)
            return self.resolve(request)
        except InvalidRequest as exc:
            raise bad(str(exc)) from None

    def _default_max_tokens(self, prompt_tokens: int) -> int:
        """What a chat without max_tokens may generate: the deployment's default, within the
        context and the KV pool (so that it is served, never refused for a number it did not send)."""
        room = [self.settings.default_max_tokens, self.settings.max_tokens_cap]
        for limit in (self.context, self.kv_tokens):
            if limit is not None:
                room.append(limit - prompt_tokens)
        return max(1, min(room))
