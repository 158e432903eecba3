"""What vLLM's hermes tool-call parser makes of generated text, for tests that run where vLLM is not installed (the
project's venv, beside ART's trainer): tests/test_vllm.py checks the format against the real parser."""

from __future__ import annotations

import json
import re

# An unclosed final <tool_call> still counts: generation may stop at <|im_end|> or max_tokens.
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]*)"')


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split generated text into (content, OpenAI tool_calls).

    Content is the text outside the tags (None if empty). When the JSON inside the tags is invalid the
    call keeps the raw text as `arguments`, so the client can report "arguments are not JSON".
    """
    calls = []
    for n, match in enumerate(_TOOL_CALL_RE.finditer(text)):
        raw = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            parsed = json.loads(raw)
            name, arguments = parsed["name"], parsed.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name is not a string")
            # as vLLM's hermes parser: whatever "arguments" holds is encoded, so a JSON string written where an
            # object belongs (double-encoded arguments) stays a string and the tool refuses it
            arguments = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, KeyError, TypeError, AttributeError):
            found = _NAME_RE.search(raw)
            name, arguments = (found.group(1) if found else ""), raw
        calls.append({"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": arguments}})
    if not calls:
        return (text or None), []
    return (_TOOL_CALL_RE.sub("", text).strip() or None), calls
