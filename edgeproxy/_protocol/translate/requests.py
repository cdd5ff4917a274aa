"""Anthropic Messages and stateless Responses requests as the chat completion a region
that speaks only chat completions is sent (see :mod:`edgeproxy._protocol.translate`).

What has no chat equivalent is refused with the client's API's 400 (``untranslatable``),
naming the field; what only tunes a server's own features (Anthropic's ``thinking``, a
Responses request's ``reasoning``, ``include``, ``truncation``) is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import orjson

from edgeproxy._core.errors import ProxyError

__all__ = ["Untranslatable", "count_request", "messages_request", "responses_request"]

# What every streamed translation asks: a chat stream says its usage only when asked.
_STREAM: Final = {"stream": True, "stream_options": {"include_usage": True}}
# Messages blocks and Responses items that say nothing a chat model is sent again.
_SILENT_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})
_SILENT_ITEMS: Final = frozenset({"reasoning"})
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text", "refusal"})


class Untranslatable(ValueError):
    """A request field chat completions cannot carry: the 400's message and field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise Untranslatable(f"{where} must be a string", where)
    return value


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: a string when it is text alone (what every server and chat template
    reads), else the parts."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _sampling(body: dict[str, Any], out: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = body.get(key)
        if value is not None:
            out[key] = value


# -- Anthropic Messages ------------------------------------------------------------------


def _image(source: Any, where: str) -> dict[str, Any]:
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "url":
        url = _text(source.get("url"), where + ".source.url")
    else:
        raise Untranslatable(f"{where}: only base64 and url images can be translated", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise Untranslatable(
                    f"{where}.content: a tool result of text only can be translated",
                    f"{where}.content[{j}]",
                )
            texts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
        text = "\n".join(texts)
    else:
        raise Untranslatable(f"{where}.content must be a string or blocks", where + ".content")
    call = _text(block.get("tool_use_id"), where + ".tool_use_id")
    return {"role": "tool", "tool_call_id": call, "content": text}


def _assistant_turn(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block.get("text"), at + ".text"))
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": _text(block.get("name"), at + ".name"), "arguments": arguments}
            calls.append(
                {"id": _text(block.get("id"), at + ".id"), "type": "function", "function": function}
            )
        elif kind not in _SILENT_BLOCKS:
            raise Untranslatable(f"{at}: a {kind!r} block cannot be translated", at)
    turn: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not calls else None,
    }
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: its tool results first (chat's ``tool`` messages answer the
    calls of the turn before), then its text and images."""
    turns: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block.get("text"), at + ".text")})
        elif kind == "image":
            parts.append(_image(block.get("source"), at))
        elif kind == "tool_result":
            turns.append(_tool_result(block, at))
        else:
            raise Untranslatable(f"{at}: a {kind!r} block cannot be translated", at)
    if parts:
        turns.append({"role": "user", "content": _joined(parts)})
    return turns


def _messages_turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        texts = []
        for j, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise Untranslatable("system: only text blocks can be translated", f"system[{j}]")
            texts.append(_text(block.get("text"), f"system[{j}].text"))
        system = "\n".join(texts)
    if system:
        turns.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise Untranslatable("messages must be a list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise Untranslatable(f"{where}.role must be 'user' or 'assistant'", where + ".role")
        content = message.get("content")
        if isinstance(content, str):
            turns.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise Untranslatable(f"{where}.content must be a string or blocks", where + ".content")
        elif role == "assistant":
            turns.append(_assistant_turn(content, where + ".content"))
        else:
            turns.extend(_user_turns(content, where + ".content"))
    return turns


def _chat_tools(
    body: dict[str, Any],
    out: dict[str, Any],
    kinds: tuple[str | None, ...],
    other: str,
    function: Callable[[dict[str, Any], str], dict[str, Any]],
) -> None:
    """``body``'s tools as chat's functions (each made by ``function``) in ``out``; a tool
    of any type but ``kinds`` (an ``other`` tool, run by the API's server) cannot be."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return
    functions = []
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in kinds:
            raise Untranslatable(f"{where}: the {other} tool {kind!r} cannot be translated", where)
        functions.append({"type": "function", "function": function(tool, where)})
    out["tools"] = functions


def _messages_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": _text(tool.get("name"), where + ".name")}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema") or {"type": "object"}
    return function


def _responses_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function = {"name": _text(tool.get("name"), where + ".name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return function


def _messages_tools(body: dict[str, Any], out: dict[str, Any]) -> None:
    _chat_tools(body, out, (None, "custom"), "server", _messages_function)
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False


def messages_request(body: dict[str, Any], *, model: str, method: str) -> dict[str, Any]:
    """A Messages request as a chat completion request for ``model`` (the region's name
    for it). A conversation ending with an assistant turn (a prefill, the client's or a
    continued stream's) is continued as the region continues a chat (``method``: vLLM's
    and SGLang's ``continue_final_message`` switches)."""
    turns = _messages_turns(body)
    out: dict[str, Any] = {"model": model, "messages": turns}
    _sampling(body, out, ("max_tokens", "temperature", "top_p", "top_k"))
    stop = body.get("stop_sequences")
    if stop:
        out["stop"] = stop
    _messages_tools(body, out)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        out["user"] = metadata["user_id"]
    if turns and turns[-1]["role"] == "assistant" and method == "continue_final_message":
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    if body.get("stream") is True:
        out.update(_STREAM)
    return out


def count_request(body: dict[str, Any], *, model: str) -> dict[str, Any]:
    """A token count as the least chat completion that counts the prompt: one token
    generated, its ``usage.prompt_tokens`` the count, the tools counted too."""
    out: dict[str, Any] = {"model": model, "messages": _messages_turns(body), "max_tokens": 1}
    _messages_tools(body, out)
    return out


# -- the Responses API -------------------------------------------------------------------


def _response_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            value = part.get("text") if kind != "refusal" else part.get("refusal")
            parts.append({"type": "text", "text": _text(value, at + ".text")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise Untranslatable(f"{at}: a {kind!r} part cannot be translated", at)
    return parts


def _responses_turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        turns.append({"role": "system", "content": _text(instructions, "instructions")})
    given = body.get("input")
    if isinstance(given, str):
        turns.append({"role": "user", "content": given})
        return turns
    if not isinstance(given, list):
        raise Untranslatable("input must be a string or a list of items", "input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Untranslatable(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Untranslatable(f"{where}.role cannot be translated", where + ".role")
            content = item.get("content")
            if isinstance(content, list):
                content = _joined(_response_parts(content, where + ".content"))
            # Chat templates know system, not OpenAI's newer name for it.
            turns.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _text(item.get("call_id"), where + ".call_id"),
                "type": "function",
                "function": {
                    "name": _text(item.get("name"), where + ".name"),
                    "arguments": _text(item.get("arguments"), where + ".arguments"),
                },
            }
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _joined(_response_parts(output, where + ".output"))
            call_id = _text(item.get("call_id"), where + ".call_id")
            turns.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind not in _SILENT_ITEMS:
            raise Untranslatable(f"{where}: a {kind!r} item cannot be translated", where)
    return turns


def _responses_tools(body: dict[str, Any], out: dict[str, Any]) -> None:
    _chat_tools(body, out, ("function",), "built-in", _responses_function)
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(body.get("parallel_tool_calls"), bool):
        out["parallel_tool_calls"] = body["parallel_tool_calls"]


def _response_format(body: dict[str, Any], out: dict[str, Any]) -> None:
    text = body.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict):
        return
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif form.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}


def responses_request(body: dict[str, Any], *, model: str) -> dict[str, Any]:
    """A stateless Responses request as a chat completion request for ``model``."""
    out: dict[str, Any] = {"model": model, "messages": _responses_turns(body)}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    _sampling(body, out, ("temperature", "top_p"))
    _responses_tools(body, out)
    _response_format(body, out)
    if isinstance(body.get("user"), str):
        out["user"] = body["user"]
    if body.get("stream") is True:
        out.update(_STREAM)
    return out


def untranslatable(err: Untranslatable, region: str) -> ProxyError:
    """The 400 of a request the region cannot be sent in chat completions."""
    return ProxyError(
        400,
        "invalid_request_error",
        f"region {region} speaks chat completions only, and this request cannot be "
        f"translated to them: {err.message}",
        code="untranslatable",
        param=err.param,
    )
