"""A scripted stand-in for the LLM: an OpenAI-compatible chat-completions server on 127.0.0.1.

Each question (the first user message) has a script: a list of replies, one per assistant turn; scripts may also be
keyed by model name first ({model: {question: script}}), and "*" is the script for any other question (e.g. a
judge's reply). A reply is a dict: {"tool": name, "args": dict | raw str} for one call, {"calls": [(name, args),
...]} for several, {"text": "..."} for plain text, {"status": 500, "message": "..."} for an HTTP error (message
optional), {"raw": body} for a whole response body of its own, {"sleep": s} to stall; a call or text reply with
"sampled" samples that text instead of the one the reply renders back to (a call written otherwise). A
script may also be a
function of the request body that returns one reply (for replies that depend on the prompt or on earlier calls). A
question with no script gets {"status": 404}. GET /v1/models lists `models` (none by default: "serves anything");
POST /v1/load_lora_adapter is recorded in `adapters`, as vLLM would load a LoRA. With `api_key`, any request without
`Authorization: Bearer <api_key>` gets HTTP 401. Tests and benches use it; the real model path is the CPU backend.

With a `tokenizer` it serves as vLLM does (`sampled`): it renders each prompt with the tokenizer's chat
template the way vLLM's chat endpoint prepares it (tool schemas as vLLM's pydantic models dump them, earlier
tool-call arguments parsed into objects), writes the reply as the hermes text a model would sample, returns its
token ids as logprobs in the "token_id:N" form ART reads, and records each request's prompt and sampled ids in
`served`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

from aiohttp import web


def call(name, args):
    return {"tool": name, "args": args}


def expert_script(question, answer=None, sources=None):
    """Search with the question's capitalised words, read the gold email, answer (for tests only)."""
    keywords = [w.strip("?,.'s") for w in question.question.split()[1:] if w[:1].isupper() and len(w) > 3]
    return [call("search_inbox", {"keywords": keywords[:2]}),
            call("read_email", {"message_id": question.message_ids[0]}),
            call("return_final_answer", {"answer": answer or question.answer,
                                         "sources": question.message_ids if sources is None else sources})]


def hermes_text(calls: list, text: str | None) -> str:
    """A reply as a hermes-template model writes it: text, then one <tool_call> block per call."""
    blocks = [f"<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "
              f"{args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}}\n</tool_call>"
              for name, args in calls]
    return "\n".join(([text] if text else []) + blocks)


def as_vllm_renders(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """What vLLM hands the chat template: arguments of earlier tool calls as objects, and each tool as its
    pydantic ChatCompletionToolsParam dumps it: {"type", "function": {"name", "description", "parameters"}}."""
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]]}
        rendered.append(message)
    tools = [{"type": "function", "function": {key: t["function"].get(key) for key in ("name", "description",
                                                                                        "parameters")}}
             for t in tools] if tools else None
    return rendered, tools


class ScriptedServer:
    def __init__(self, scripts: dict[str, list[dict]], models: list[str] = (), api_key: str | None = None,
                 tokenizer=None):
        self.scripts = scripts
        self.models = list(models)
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.served: list[dict] = []  # with a tokenizer: {"question", "prompt_ids", "sampled_ids"} per request
        self.requests: list[dict] = []
        self.adapters: list[dict] = []
        self._runner = None
        self.base_url = None

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        scripts = self.scripts.get(body["model"], self.scripts)
        script = scripts if callable(scripts) else scripts.get(question, scripts.get("*"))
        turn = sum(m["role"] == "assistant" for m in messages)
        if callable(script):
            script = [None] * turn + [script(body)]
        if script is None or turn >= len(script):
            return web.json_response({"error": {"message": "no script for this turn"}}, status=404)
        reply = script[turn]
        if "sleep" in reply:
            await asyncio.sleep(reply["sleep"])
        if "status" in reply:
            return web.json_response({"error": {"message": reply.get("message", "scripted failure")}},
                                     status=reply["status"])
        if "raw" in reply:  # a whole response body of the script's own, odd ones included
            return web.json_response(reply["raw"])
        calls = reply.get("calls") or ([(reply["tool"], reply["args"])] if "tool" in reply else [])
        tool_calls = [{"id": f"call_{turn}_{i}", "type": "function",
                       "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                      for i, (name, args) in enumerate(calls)]
        message = {"role": "assistant", "content": reply.get("text"), "tool_calls": tool_calls or None}
        logprobs, usage = None, {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
        if self.tokenizer is not None:
            # "sampled": the text the model wrote, when it is not what the parsed reply renders back to
            written = reply.get("sampled") or hermes_text(calls, reply.get("text"))
            logprobs, usage = self._sample(body, question, written)
        if body.get("stream"):
            return await self._stream(request, body, message, usage)
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": usage})

    async def _stream(self, request: web.Request, body: dict, message: dict, usage: dict) -> web.StreamResponse:
        """The reply as server-sent events, as a server streams it (verifiers' chat program asks for a stream): the
        whole message in one delta, the finish reason, the usage, then [DONE]."""
        delta = {"role": "assistant", "content": message["content"]}
        if message["tool_calls"]:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        head = {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion.chunk", "created": 0,
                "model": body["model"]}
        events = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "delta": {},
                                        "finish_reason": "tool_calls" if message["tool_calls"] else "stop"}]},
                  {**head, "choices": [], "usage": usage}]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _sample(self, body: dict, question: str, text: str) -> tuple[dict, dict]:
        messages, tools = as_vllm_renders(body["messages"], body.get("tools"))
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        sampled_ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.served.append({"model": body["model"], "question": question, "prompt_ids": prompt_ids,
                            "sampled_ids": sampled_ids})
        logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                for i in sampled_ids]}
        return logprobs, {"prompt_tokens": len(prompt_ids), "completion_tokens": len(sampled_ids),
                          "total_tokens": len(prompt_ids) + len(sampled_ids)}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                              "owned_by": "scripted"} for m in self.models]})

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        self.adapters.append(await request.json())
        return web.Response(text="Success")

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        return await handler(request)

    async def __aenter__(self) -> "ScriptedServer":
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc):
        await self._runner.cleanup()


@contextlib.contextmanager
def serve_in_thread(scripts, models=(), api_key=None, tokenizer=None):
    """The server on its own event loop in a thread, for code under test that runs its own loop."""
    loop = asyncio.new_event_loop()
    server = ScriptedServer(scripts, models, api_key, tokenizer)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
