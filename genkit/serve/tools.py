"""Tools (function calling) in ``genkit serve``'s chat completions.

- **In the prompt.** ``tools`` reach the chat template as ``tools=`` (the convention of
  transformers' templates). A template that never mentions ``tools`` gets them as a system message
  instead (:data:`SYSTEM_PROMPT`, the Hermes/Qwen convention: one JSON signature per line inside
  ``<tools></tools>``, calls written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
  and the conversation's earlier calls and results are written the same way (an assistant message's
  ``tool_calls`` as ``<tool_call>`` blocks, a ``tool`` message as a user message holding
  ``<tool_response>...</tool_response>``).
- **In the output.** :func:`parse_tool_calls` reads Hermes/Qwen ``<tool_call>{...}</tool_call>``
  blocks, and Llama 3's bare ``{"name": ..., "parameters": {...}}`` (one, or several separated by
  ``;``); they become OpenAI ``tool_calls`` with ``finish_reason: "tool_calls"``.
- **``tool_choice``.** ``"auto"`` (the default with tools): the model may answer or call;
  ``"none"``: the tools are left out of the prompt and nothing is parsed; ``"required"``: the output
  is constrained (the structured-output processor, ``guided_json``) to a JSON list of one or more
  calls (one with ``parallel_tool_calls: false``), each ``{"name", "arguments"}`` matching one
  tool's ``parameters``; a named function: the output is constrained to that function's
  ``parameters`` and is its arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .openai_api import APIError

__all__ = ["SYSTEM_PROMPT", "ToolPlan", "ToolStream", "parse_tool_calls", "parse_tools", "template_has_tools",
           "tool_message", "with_tools"]

SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or a name)."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True
    named: bool = False

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return dict(tool["function"].get("parameters") or _EMPTY_PARAMETERS)

    def generate_kwargs(self) -> dict[str, Any]:
        """The structured-output setting ``required`` and a named choice run with."""
        if self.named:
            return {"guided_json": self.parameters(self.choice)}
        if self.choice != "required":
            return {}
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": self.parameters(t["function"]["name"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"guided_json": schema}

    def split(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a choice's text (no calls: the model answered in words)."""
        if self.choice == "none":
            return text, []
        if self.named:
            return "", [_call(self.choice, text.strip())]
        if self.choice == "required":
            found = _json(text)
            calls = [_as_call(c) for c in found] if isinstance(found, list) else []
            return ("", [c for c in calls if c is not None]) if calls and None not in calls else (text, [])
        return parse_tool_calls(text)

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a choice, and its finish reason (``"tool_calls"`` where it
        called tools and stopped by itself)."""
        content, calls = self.split(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content or None, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)


def parse_tools(body: dict[str, Any]) -> ToolPlan | None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(f"`parallel_tool_calls` must be true or false; got {parallel!r}", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise APIError("`tool_choice` needs `tools`", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError("`tools` must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects",
                       "tools")
    names = [_check_tool(t, i) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise APIError(f"`tools` names a function twice: {names}", "tools")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(tools, choice or "auto", parallel)
    function = choice.get("function") if isinstance(choice, dict) else None  # `function` may be anything sent
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise APIError('`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": '
                       f'{{"name": one of {names}}}}}; got {choice!r}', "tool_choice")
    return ToolPlan(tools, name, parallel, named=True)


def _check_tool(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise APIError(f'`tools[{i}]` must be {{"type": "function", "function": {{"name": ..., "parameters": '
                       f"{{...}}}}}}; got {tool!r}", "tools")
    name, params = fn.get("name"), fn.get("parameters")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError(f"`tools[{i}].function.name` must be 1-64 letters, digits, _ or -; got {name!r}", "tools")
    if params is not None and not isinstance(params, dict):
        raise APIError(f"`tools[{i}].function.parameters` must be a JSON schema object; got {params!r}", "tools")
    return name


def template_has_tools(template: Any) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return isinstance(template, str) and "tools" in template


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan | None,
               native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the template's extra arguments that put the tools in the prompt: ``tools=``
    for a template that renders them (``native``), else a system message (:data:`SYSTEM_PROMPT`)."""
    if plan is None or plan.choice == "none":
        return messages, {}
    if native:
        return messages, {"tools": plan.tools}
    note = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
    messages = list(messages)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
    else:
        messages.insert(0, {"role": "system", "content": note})
    return messages, {}


def tool_message(i: int, m: dict[str, Any], content: str, native: bool) -> dict[str, Any]:
    """A ``tool`` message (a result) or an assistant message with ``tool_calls``, for the template:
    as it takes them (``native``) or written in the Hermes convention."""
    if m["role"] == "tool":
        if native:
            return {"role": "tool", "content": content, "tool_call_id": m.get("tool_call_id")}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or not isinstance(calls, list) or not calls:
        raise APIError(f"`messages[{i}].tool_calls` must be a non-empty list, on an assistant message", "messages")
    parsed = [_history_call(c, i) for c in calls]
    if native:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "id": c.get("id"), "function": f} for c, f in zip(calls, parsed)]}
    blocks = "\n".join(f"{_OPEN}\n{json.dumps(f, ensure_ascii=False)}\n{_CLOSE}" for f in parsed)
    return {"role": "assistant", "content": (content + "\n" if content else "") + blocks}


def _history_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"`messages[{i}].tool_calls` entries must be {{\"id\", \"type\": \"function\", \"function\": "
                       "{\"name\", \"arguments\"}}", "messages")
    arguments = fn.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as exc:
        raise APIError(f"`messages[{i}].tool_calls`: the arguments of `{fn['name']}` are not JSON: {exc}",
                       "messages") from exc
    return {"name": fn["name"], "arguments": arguments}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return _call(obj["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model's text: Hermes/Qwen ``<tool_call>`` blocks, or Llama
    3's bare JSON call(s). Text that holds no well-formed call is all content."""
    if _OPEN in text:
        calls = []
        for block in _BLOCK.findall(text):
            try:
                call = _as_call(json.loads(block))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:text.index(_OPEN)].strip(), calls
    stripped = text.strip().removeprefix("<|python_tag|>")
    if stripped.startswith("{"):
        found = [_as_call(_json(part)) for part in stripped.split(";")]
        if found and all(c is not None for c in found):
            return "", [c for c in found if c is not None]
    return text, []


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class ToolStream:
    """One choice's streamed deltas under tools: content is released as it comes until it may
    begin a tool call; from there the text is held, and at the end it becomes ``tool_calls``
    deltas (or, holding no call, content). A named choice streams its arguments as they come."""

    plan: ToolPlan
    held: str = ""
    sent_name: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)  # log-probability entries not sent yet

    def delta(self, text: str) -> list[dict[str, Any]]:
        """The deltas for new text of this choice."""
        if self.plan.choice == "none":
            return [{"content": text}] if text else []
        if self.plan.named:
            out = [] if self.sent_name else [self._head(0, _call(self.plan.choice, ""))]
            self.sent_name = True
            return out + ([{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else [])
        self.held += text
        if self.plan.choice == "required":
            return []
        start = self.held.find(_OPEN)
        if start == -1:
            start = _partial_open(self.held)
        if start == 0 or self.held.lstrip().startswith("{"):
            return []
        cut = len(self.held) if start == -1 else start
        release, self.held = self.held[:cut], self.held[cut:]
        return [{"content": release}] if release else []

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the choice made tool calls."""
        if self.plan.choice == "none":
            return [], False
        if self.plan.named:
            return ([] if self.sent_name else [self._head(0, _call(self.plan.choice, "{}"))]), True
        _, self.calls = self.plan.split(self.held)
        if not self.calls:
            return ([{"content": self.held}] if self.held else []), False
        out = []
        for k, call in enumerate(self.calls):
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            out.append(self._head(k, {**call, "function": {**call["function"], "arguments": arguments[:half]}}))
            out.append({"tool_calls": [{"index": k, "function": {"arguments": arguments[half:]}}]})
        return out, True

    def chunks(self, index: int, text: str, finish: str | None, entries: list[Any] | None = None,
               logprobs: Callable[[list[Any]], Any] | None = None) -> list[dict[str, Any]]:
        """The streamed ``choices`` entries for choice ``index``'s new text and, once it ends, its
        finish reason (``"tool_calls"`` where it called tools and stopped by itself). ``entries``:
        the log-probabilities of the tokens behind ``text`` (when the request asked for them),
        rendered by ``logprobs``. As vLLM sends a step's log-probabilities with the delta of that
        step, they go with the next chunk sent: the one releasing the text (or the tool call) they
        belong to, the finish chunk at the latest; so every token's entry is sent once, in order."""
        self.pending += entries or []
        deltas = self.delta(text) if text else []
        if finish is not None:
            last, called = self.finish()
            deltas += last
            finish = "tool_calls" if called and finish == "stop" else finish
        out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if finish is not None:
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
        if out and self.pending and logprobs is not None:
            out[0]["logprobs"], self.pending = logprobs(self.pending), []
        return out

    @staticmethod
    def _head(index: int, call: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"],
                                             "arguments": call["function"]["arguments"]}}]}


def _partial_open(text: str) -> int:
    """Where a trailing prefix of ``<tool_call>`` starts in ``text``, or -1."""
    for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(_OPEN[:k]):
            return len(text) - k
    return -1
