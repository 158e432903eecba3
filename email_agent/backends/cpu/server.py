"""The OpenAI-compatible chat-completions server (aiohttp, on 127.0.0.1, in the caller's event loop), and
`serve_checkpoint`, which serves one checkpoint or the bare base model without training.

Owns the HTTP surface: request validation, rendering messages with the chat template, tokenizing, and
turning a finished `Generation` into an OpenAI response with tool calls and logprobs in the form ART reads.
Generation itself runs in the `engine`; this module never touches the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from aiohttp import web

from .checkpoints import load_merged
from .engine import EngineClosed, Generation, Worker
from .model import load_base_model
from .toolcalls import parse_tool_calls

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # when a request sets none: unbounded CPU decoding would stall a rollout for minutes


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error_response(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _RequestError(400, f"{key} must be a number in [{low}, {high}]")
    return float(value)


class Server:
    """OpenAI-compatible chat completions on 127.0.0.1 (a free port), in the caller's event loop."""

    def __init__(self, worker: Worker, served_names: Callable[[], list[str]], rng: random.Random) -> None:
        self.worker = worker
        self.served_names = served_names
        self.rng = rng  # seeds the requests that bring no seed, so a seeded run replays
        # The server's own tokenizer copy: HF fast tokenizers must not be shared across threads.
        self.tokenizer = copy.deepcopy(worker.tokenizer)
        self.context_length = worker.model.config.max_position_embeddings
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)  # port 0: the OS picks a free port, no race
        await site.start()
        self.port = self.runner.addresses[0][1]
        logger.info("serving %s at http://127.0.0.1:%d/v1", ", ".join(self.served_names()), self.port)
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except _RequestError as error:
            return _error_response(error.status, str(error))
        except web.HTTPException as error:
            return _error_response(error.status, error.reason)
        except EngineClosed as error:  # shutting down (Ctrl-C mid-step): expected, not worth a line per request
            return _error_response(503, str(error))
        except Exception as error:  # noqa: BLE001 (a failed request must not take the server down)
            logger.warning("request failed: %s: %s", type(error).__name__, error)
            return _error_response(500, f"{type(error).__name__}: {error}")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "cpu-backend"}
            for name in self.served_names()]})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as error:
            raise _RequestError(400, f"request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise _RequestError(400, "request body must be a JSON object")
        name = body.get("model")
        if name not in self.served_names():
            raise _RequestError(404, f"model {name!r} is not served here (serving: {self.served_names()})")
        if body.get("n", 1) != 1:
            raise _RequestError(400, "only n=1 is supported")
        if body.get("stream"):
            raise _RequestError(400, "streaming is not supported")
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages):
            raise _RequestError(400, "messages must be a non-empty list of system/user/assistant/tool messages")
        if tools is not None and not isinstance(tools, list):
            raise _RequestError(400, "tools must be a list")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 1e-9, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _RequestError(400, "seed must be an integer")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise _RequestError(400, "max_tokens must be a positive integer")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                        tokenize=False)
        except Exception as error:  # noqa: BLE001 (malformed messages surface here)
            raise _RequestError(400, f"could not render the messages: {type(error).__name__}: {error}") from None
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        room = self.context_length - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if max_tokens < 1 or max_tokens > room:
            raise _RequestError(400, f"context length exceeded: the prompt has {len(prompt_ids)} tokens and "
                                f"max_tokens is {max_tokens}, but the model's context window is "
                                f"{self.context_length} tokens")
        generator = torch.Generator().manual_seed(seed if seed is not None else self.rng.getrandbits(63))
        loop = asyncio.get_running_loop()
        row = await self.worker.generate(Generation(
            prompt_ids, max_tokens, temperature, top_p, bool(body.get("ignore_eos")), generator,
            loop, loop.create_future()))
        return web.json_response(self._completion(name, body.get("tool_choice"), row))

    def _completion(self, name: str, tool_choice: Any, row: Generation) -> dict:
        text_ids = row.tokens[:-1] if row.finish_reason == "stop" else row.tokens
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        content, calls = (text or None, []) if tool_choice == "none" else parse_tool_calls(text)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls" if calls else row.finish_reason,
                # Always returned (as ART's patched vLLM does), in the "token_id:N" form ART's tokenizer reads.
                "logprobs": {"content": [
                    {"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": []}
                    for token, logprob in zip(row.tokens, row.logprobs)]},
            }],
            "usage": {"prompt_tokens": len(row.prompt_ids), "completion_tokens": len(row.tokens),
                      "total_tokens": len(row.prompt_ids) + len(row.tokens)},
        }


@contextlib.asynccontextmanager
async def serve_checkpoint(base_model: str, checkpoint_dir: str | None, served_name: str, *,
                           seed: int = 0, max_batch_size: int = 8) -> AsyncIterator[str]:
    """Serve a LoRA checkpoint (or, with checkpoint_dir=None, the bare base model) as `served_name`.

    `async with serve_checkpoint(...) as base_url:` yields "http://127.0.0.1:PORT/v1".
    """
    worker = Worker(max_batch_size, name="cpu-serve-worker")
    server = None
    try:
        await worker.call(_load_for_serving, worker, base_model, checkpoint_dir)
        server = Server(worker, lambda: [served_name], random.Random(seed))
        yield await server.start()
    finally:
        worker.close()
        if server is not None:
            await server.stop()


def _load_for_serving(worker: Worker, base_model: str, checkpoint_dir: str | None) -> None:
    model, tokenizer = load_base_model(base_model)
    if checkpoint_dir is not None:
        model = load_merged(model, checkpoint_dir)
    worker.serve(model.eval(), tokenizer)
