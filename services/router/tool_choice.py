"""A named ``tool_choice`` as every engine takes it (issue 26).

OpenAI's ``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or a named function
(``{"type": "function", "function": {"name": "get_weather"}}``). llama.cpp's server reads it only as
a string: an object is dropped with a warning and the request runs as ``"auto"``, so the model may
answer in text or call another tool. The same request with ``tools`` narrowed to the named one and
``tool_choice: "required"`` means the same thing (call that function) and every engine honours it:
llama.cpp then holds the output to that function's call with its grammar, vLLM likewise.
"""

from __future__ import annotations

from typing import Any


def named_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names, or None when it names none (a string, or another shape)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def named_tool_as_required(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a named ``tool_choice`` turned into ``tools`` = that function and ``"required"``;
    ``body`` itself (the same object) when there is nothing to turn. A name that none of the tools
    carries is left for the engine to refuse, as it would refuse it anyway."""
    name = named_function(body.get("tool_choice"))
    tools = body.get("tools")
    if name is None or not isinstance(tools, list):
        return body
    chosen = [t for t in tools if isinstance(t, dict) and named_function(t) == name]
    if not chosen:
        return body
    return {**body, "tools": chosen, "tool_choice": "required"}
