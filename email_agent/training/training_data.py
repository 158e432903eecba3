"""What a backend trains on, made the same for every backend: the token sequences the policy was served.

The training loop passes each GRPO step's groups through `for_grpo` and the warm start's episodes through
`for_sft` before `backend.train` / `model.train_sft`, whichever backend runs them (ours on CPU, ART's
LocalBackend on a GPU, a remote one). ART 0.5.18's tokenizer renders a trajectory with the model's chat template
and swaps each sampled Choice for the token ids the server sampled; left as the rollout records them, four
things make what it trains on differ from what the policy saw, without an error:

  tool calls twice    a sampled Choice keeps its parsed `tool_calls`, so the template renders each call again
                      after the sampled tokens, which already hold it (they are taken off)
  tool order          `art.Trajectory.tools` comes back from pydantic as {"function", "type"}; vLLM (and our CPU
                      server) render {"type", "function"}: the tool block of the prompt, which every turn sees,
                      would differ from the one sampled with (`tools_as_served`)
  arguments form      templates that put `arguments | tojson` with no string check (Qwen2.5's) encode a JSON
                      string a second time; vLLM hands them objects. The warm start's episodes carry strings
                      (OpenAI's wire format), so it would teach double-encoded arguments (`argument_form`)
  calls re-rendered   a call the model wrote otherwise than the template writes what vLLM's hermes parser read
                      (a key beside "name" and "arguments", text after it, no closing tag, other spacing) comes
                      back changed in every later prompt, while the sampled tokens keep it: later turns would
                      train on a context no prompt had. Such a turn is trained as the message the server
                      rendered, not on its sampled ids (`renders_as_sampled`)

It does not tokenize (ART does) and knows nothing of backends: they receive what it returns.
"""

from __future__ import annotations

import json
from typing import Literal

from art import Trajectory, TrajectoryGroup
from art.trajectories import get_messages
from openai.types.chat.chat_completion import Choice
from transformers.utils.chat_template_utils import render_jinja_template

ArgumentForm = Literal["string", "object"]
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")  # vLLM's FunctionDefinition, in its order


def tools_as_served(tools: list | None) -> list | None:
    """Tool schemas in the order vLLM renders them: {"type", "function": {"name", "description", "parameters"}}."""
    if tools is None:
        return None
    served = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            served.append(tool)
            continue
        ordered = {key: function[key] for key in _FUNCTION_KEYS if key in function}
        ordered.update({key: value for key, value in function.items() if key not in ordered})
        served.append({"type": tool.get("type", "function"), "function": ordered,
                       **{key: value for key, value in tool.items() if key not in ("type", "function")}})
    return served


def argument_form(chat_template: str | None) -> ArgumentForm:
    """How `chat_template` wants an assistant message's tool-call arguments: "object" when it encodes a string
    a second time (it would render '"{\\"k\\": ...}"'), else "string" (rendered verbatim, or converted by ART
    itself for templates that iterate over them with `|items`, where ART insists on strings)."""
    if not isinstance(chat_template, str):
        return "string"
    arguments = '{"probe": "value"}'
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": arguments}}]}]
    try:
        rendered, _ = render_jinja_template([messages], chat_template=chat_template)
    except Exception:  # noqa: BLE001 (a template that cannot take a string at all: ART converts for `|items`)
        return "string"
    return "object" if json.dumps(arguments) in rendered[0] else "string"


def _message(message: dict, form: ArgumentForm) -> dict:
    """An assistant message's tool-call arguments in `form` (a string that is not a JSON object stays as it is:
    the model's own malformed call, which the template must show as it was)."""
    calls = message.get("tool_calls")
    if form == "string" or not calls:
        return message
    converted = []
    for call in calls:
        function = call.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        converted.append(call)
    return {**message, "tool_calls": converted}


def sampled_ids(choice: Choice) -> list[int] | None:
    """The token ids a server sampled, from logprobs named "token_id:N" (vLLM's --return-tokens-as-token-ids);
    None when the tokens are named otherwise."""
    tokens = [entry.token for entry in choice.logprobs.content or []]
    if not all(token.startswith("token_id:") for token in tokens):
        return None
    return [int(token.removeprefix("token_id:")) for token in tokens]


def renders_as_sampled(choice: Choice, tokenizer) -> bool:
    """Whether every later prompt shows a sampled Choice as the text it sampled. A server renders an earlier turn
    from the calls its tool parser read (arguments as objects, as vLLM hands them to the template), so a call
    written otherwise comes back changed: a key beside "name" and "arguments", text after the call, a call left
    without its closing tag (cut off, or ended early), other spacing. Compared as ART 0.5.18 builds the trained
    sequence: the template's text before the turn, the sampled text, then what the template writes after a turn
    (without its first token when the turn sampled that token too). A Choice without calls, or without token ids
    and a `tokenizer` to read them, is taken as sampled."""
    ids = sampled_ids(choice) if tokenizer is not None and choice.message.tool_calls else None
    if not ids:
        return True
    opening = [{"role": "user", "content": "."}]
    marker = "\u2063"  # a character no template writes, to find where a turn's content ends
    head = tokenizer.apply_chat_template(opening, add_generation_prompt=True, tokenize=False)
    plain = tokenizer.apply_chat_template(opening + [{"role": "assistant", "content": marker}], tokenize=False)
    after = plain[plain.index(marker) + len(marker):]
    served = tokenizer.apply_chat_template(opening + [_message(get_messages([choice])[0], "object")], tokenize=False)
    sampled = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    last = tokenizer.decode(ids[-1:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return served in (head + sampled + after, head + sampled + after.removeprefix(last))


def _items(items: list, form: ArgumentForm, tokenizer=None) -> list:
    """Sampled Choices without their parsed tool calls (their tokens hold them); Choices with no sampled tokens
    (a scripted expert's, a teacher's), sampled ones the parser kept only part of (when a `tokenizer` can read
    them), and dict messages as chat messages with arguments in `form`."""
    out = []
    for item in items:
        if isinstance(item, Choice) and item.logprobs is not None and renders_as_sampled(item, tokenizer):
            if item.message.tool_calls:
                item = item.model_copy(update={"message": item.message.model_copy(update={"tool_calls": None})})
            out.append(item)
        elif isinstance(item, Choice):
            out.append(_message(get_messages([item])[0], form))
        else:
            out.append(_message(item, form))
    return out


def _trajectory(trajectory: Trajectory, form: ArgumentForm, tokenizer=None) -> Trajectory:
    # model_copy, not a new Trajectory: pydantic validation would put the tools back in {"function", "type"} order
    return trajectory.model_copy(update={
        "messages_and_choices": _items(trajectory.messages_and_choices, form, tokenizer),
        "tools": tools_as_served(trajectory.tools),
        "additional_histories": [history.model_copy(update={
            "messages_and_choices": _items(history.messages_and_choices, form, tokenizer),
            "tools": tools_as_served(history.tools)}) for history in trajectory.additional_histories]})


def for_grpo(groups: list[TrajectoryGroup], form: ArgumentForm, tokenizer=None) -> list[TrajectoryGroup]:
    """A step's groups as every backend should tokenize them: each trained sequence is the prompt the server
    rendered plus the ids it sampled, turn after turn (with the model's `tokenizer`, the turns the tool parser kept
    only part of are found: those are rendered as the server rendered them, and not trained on). Rewards are left
    as they are: which groups train is the loop's choice (`loop.grpo`)."""
    return [group.model_copy(update={"trajectories": [_trajectory(t, form, tokenizer) for t in group.trajectories]})
            for group in groups]


def for_sft(trajectories: list[Trajectory], form: ArgumentForm) -> list[Trajectory]:
    """Warm-start episodes as chat messages the model's template renders the way the server would have."""
    return [_trajectory(t, form) for t in trajectories]
