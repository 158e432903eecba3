"""Run by .venv-verifiers' Python (tests/test_verifiers_taskset.py): the taskset loaded by verifiers' own loader,
its tool server's handlers, its hooks and its scoring, on episodes given on stdin. Prints one JSON object.

stdin: {"db": path, "run"|limit fields..., "episodes": [{"question_id": id, "replies": [{"content": text|null,
"tool_calls": [[name, arguments as sent], ...]}, ...]}], "tool_calls": [[question_id, name, arguments], ...]}
"""

import asyncio
import json
import sys

import verifiers.v1 as vf
from mcp.server.mcpserver import MCPServer
from verifiers.v1.graph import MessageNode
from verifiers.v1.types import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage

from email_inbox.tools import InboxToolset


def trace_of(task, replies: list[dict]) -> vf.Trace:
    """The trace verifiers records for `replies`: the prompt, then each sampled reply."""
    nodes = [MessageNode(parent=None, message=SystemMessage(content=task.data.system_prompt), sampled=False),
             MessageNode(parent=0, message=UserMessage(content=task.data.prompt), sampled=False)]
    for turn, reply in enumerate(replies):
        calls = [ToolCall(id=f"call-{turn}-{i}", name=name, arguments=args)
                 for i, (name, args) in enumerate(reply["tool_calls"])]
        nodes.append(MessageNode(parent=len(nodes) - 1, sampled=True,
                                 message=AssistantMessage(content=reply["content"], tool_calls=calls or None)))
    return vf.Trace(agent=vf.AgentInfo(config=vf.AgentConfig()), task=vf.TraceTask(type="EmailTask", data=task.data),
                    nodes=nodes)


async def main(request: dict) -> dict:
    config = {key: value for key, value in request.items() if key not in ("episodes", "tool_calls")}
    taskset = vf.load_taskset(vf.taskset_config_type("email-inbox")(id="email-inbox", **config))
    tasks = {task.data.question_id: task for task in taskset}
    out = {"order": [task.data.question_id for task in taskset],
           "prompts": {str(qid): [task.data.system_prompt, task.data.prompt] for qid, task in tasks.items()}}

    scored = []
    for episode in request["episodes"]:
        task = tasks[episode["question_id"]]
        trace = trace_of(task, episode["replies"])
        stops = [bool(task.answered(vf.Response(id="r", created=0, model="m", finish_reason="tool_calls",
                                                message=trace.assistant_messages[i]))) for i in
                 range(len(episode["replies"]))]
        await task.score(trace)
        scored.append({"question_id": episode["question_id"], "rewards": {k: r.score for k, r in trace.rewards.items()},
                       "metrics": trace.metrics, "answer": trace.info["email_inbox"]["graded"]["answer"],
                       "answered_at": stops})
    out["scored"] = scored

    # The tool server's two handlers, on a real MCPServer, scoped to each call's question.
    results = []
    for qid, name, arguments in request.get("tool_calls", []):
        toolset = InboxToolset(vf.ToolsetConfig())
        await toolset.setup_task(tasks[qid].data)
        server = MCPServer("email-inbox-check")
        toolset.register(server)
        listed = await server.list_tools()
        result = await server.call_tool(name, json.loads(arguments) if arguments.startswith("{") else arguments)
        results.append({"listed": [tool.model_dump(mode="json", exclude_none=True, by_alias=True) for tool in listed],
                        "content": [block.text for block in result.content], "is_error": bool(result.is_error)})
    out["tool_results"] = results

    # The request hook: a turn's second call, a made-up tool and non-JSON arguments get the project's own words.
    task = next(iter(tasks.values()))
    assistant = AssistantMessage(content=None, tool_calls=[
        ToolCall(id="a", name="search_inbox", arguments='{"keywords": ["x"]}'),
        ToolCall(id="b", name="read_email", arguments='{"message_id": "m"}')])
    odd = AssistantMessage(content=None, tool_calls=[ToolCall(id="c", name="send_email", arguments="{}")])
    broken = AssistantMessage(content=None, tool_calls=[ToolCall(id="d", name="search_inbox", arguments="{bad")])
    messages = [UserMessage(content="q"), assistant, ToolMessage(tool_call_id="a", content="results"),
                ToolMessage(tool_call_id="b", content=""), odd, ToolMessage(tool_call_id="c", content=""),
                broken, ToolMessage(tool_call_id="d", content="")]
    rewritten = task.project_tool_errors(vf.Request(messages=messages))
    out["rewritten"] = [m.content for m in rewritten.messages if isinstance(m, ToolMessage)]
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.load(sys.stdin))), default=str))
