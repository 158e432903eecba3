"""A scripted stand-in for the LLM: an OpenAI-compatible chat-completions server on 127.0.0.1.

Each question (the first user message) has a script: a list of replies, one per assistant turn. A reply is
a dict: {"tool": name, "args": dict | raw str} for one call, {"calls": [(name, args), ...]} for several,
{"text": "..."} for plain text, {"status": 500} for an HTTP error, {"sleep": s} to stall. A question with
no script gets {"status": 404}. Tests and benches use it; the real model path is the CPU backend.
"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web


def call(name, args):
    return {"tool": name, "args": args}


class ScriptedServer:
    def __init__(self, scripts: dict[str, list[dict]]):
        self.scripts = scripts
        self.requests: list[dict] = []
        self._runner = None
        self.base_url = None

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        script = self.scripts.get(question)
        turn = sum(m["role"] == "assistant" for m in messages)
        if script is None or turn >= len(script):
            return web.json_response({"error": {"message": "no script for this turn"}}, status=404)
        reply = script[turn]
        if "sleep" in reply:
            await asyncio.sleep(reply["sleep"])
        if "status" in reply:
            return web.json_response({"error": {"message": "scripted failure"}}, status=reply["status"])
        calls = reply.get("calls") or ([(reply["tool"], reply["args"])] if "tool" in reply else [])
        tool_calls = [{"id": f"call_{turn}_{i}", "type": "function",
                       "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                      for i, (name, args) in enumerate(calls)]
        message = {"role": "assistant", "content": reply.get("text"), "tool_calls": tool_calls or None}
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}})

    async def __aenter__(self) -> "ScriptedServer":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc):
        await self._runner.cleanup()
