"""Tool calls in model output, Qwen / Hermes style, and back into chat-template form.

A model trained with Qwen's or Hermes' chat template writes a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (whitespace around the JSON
allowed). :func:`parse_tool_calls` turns the text into OpenAI ``tool_calls`` (``arguments`` a
JSON string, as the OpenAI API returns it) and the remaining content; a block whose JSON is
malformed stays in the content (the model did not make a valid call). Pure functions.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple:
    """``text`` -> ``(content or None, [tool_call dicts])``. Each tool call is
    ``{"id": "call_...", "type": "function", "function": {"name", "arguments"}}``."""
    calls, kept, pos = [], [], 0
    for m in TOOL_CALL_RE.finditer(text):
        call = _one_call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def _one_call(body: str):
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        args_text = args
    else:
        args_text = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args_text},
    }


def messages_for_template(messages: list) -> list:
    """OpenAI messages -> what HF chat templates expect: text parts joined into one string,
    tool-call ``arguments`` as mappings (Qwen/Hermes templates JSON-encode them). Raises
    ``ValueError`` naming the bad message index and field."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(
                f"messages[{i}].role={role!r}: must be system, developer, user, assistant or tool"
            )
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not (
                    isinstance(p, dict)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                ):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(p["text"])
            msg["content"] = "".join(parts)
        elif content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise ValueError(f"messages[{i}].content: required for role {role!r}")
            msg["content"] = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string or a list of text parts")
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = [_call_for_template(i, k, c) for k, c in enumerate(m["tool_calls"])]
        out.append(msg)
    if not out:
        raise ValueError("messages: must not be empty")
    return out


def _call_for_template(i: int, k: int, call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls[{k}].function.name: required")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(
                f"messages[{i}].tool_calls[{k}].function.arguments: not valid JSON"
            ) from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
