"""The agent's three tools as an MCP server, scoped to one task's inbox and day.

verifiers starts one server per rollout (`python -m email_inbox.tools`) and hands it that rollout's task
(`setup_task`): the server then searches and reads only that inbox, as of that day, as the project's rollout does.
What the model is offered (names, descriptions, JSON schemas) and what each call returns (results, or the
one-sentence error for a bad call) are email_agent.agent.tools' own, so a model trained by this project sees the
prompt it was trained on.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf

from email_agent.agent.tools import AGENT_TOOLS, Inbox, call_tool
from email_agent.data.email_db import EmailDB


class InboxToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # bare names: the model was trained to call search_inbox, not inbox_toolset_search_inbox

    inbox: Inbox | None = None

    async def setup_task(self, task) -> None:
        """`task`: the rollout's EmailTaskData."""
        self.inbox = Inbox(EmailDB(task.db), task.inbox_address, task.query_date, max_body_chars=task.max_body_chars,
                           default_max_results=task.search_results)

    def register(self, mcp) -> None:
        """The project's tools on `mcp` (an MCPServer), schemas and checking included.

        Not through `mcp.add_tool`: it derives each schema from a Python signature (titles, anyOf-null), which
        would change the prompt the model was trained on, and it validates arguments with pydantic, which drops
        unknown keys the project's checker names in its error. So the server's two tool handlers are this
        toolset's: `list_tools` offers email_agent's schemas, `call_tool` runs email_agent's `call_tool`.
        """
        from mcp_types import CallToolResult, TextContent, Tool

        async def list_tools() -> list[Tool]:
            return [Tool(name=tool.name, description=tool.description, input_schema=tool.parameters)
                    for tool in AGENT_TOOLS.values()]

        async def run_tool(name: str, arguments: dict[str, Any], context=None) -> CallToolResult:
            if self.inbox is None:  # a server started without a task (by hand): nothing is in scope
                return CallToolResult(content=[TextContent(type="text", text="Error: no inbox in scope.")],
                                      is_error=True)
            outcome = call_tool(self.inbox, name, arguments)
            return CallToolResult(content=[TextContent(type="text", text=outcome.content)])

        mcp.list_tools = list_tools
        mcp.call_tool = run_tool


if __name__ == "__main__":
    InboxToolset.run()
