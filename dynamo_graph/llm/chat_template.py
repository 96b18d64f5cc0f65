"""Chat templates rendered the way Hugging Face transformers renders them.

Models ship Jinja templates written against transformers' environment: a sandbox with
trim_blocks / lstrip_blocks, loop controls, a `tojson` filter that does not HTML-escape, and the
`raise_exception` / `strftime_now` globals. Rendering anywhere else must reproduce that
environment exactly, or prompts drift from what the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import msgspec
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_graph.llm.openai import ChatCompletionRequest

# Names `render` sets from its own arguments: a request's chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its own raise_exception, or a render error)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: Jinja's own tojson HTML-escapes and has no separators / sort_keys.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it for
    training masks); templates that use it must compile, and it renders its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's chat template, compiled once and rendered per request."""

    def __init__(self, template: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for these messages.

        continue_final_message renders without a generation prompt and cuts the text right after
        the final message's content, so the model continues that message (as transformers does).
        """
        context = {
            **self._special,
            **template_kwargs,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
        }
        try:
            rendered = self._template.render(context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except Exception as exc:  # template code is third-party: any failure means "cannot render"
            raise ChatTemplateError(f"chat template cannot render these messages: {exc!r}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """transformers' rule: cut at the last occurrence of the final message's text, keeping its
    trailing whitespace only when the template kept it too."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if isinstance(final, list):
        texts = [p["text"] for p in final if isinstance(p, dict) and isinstance(p.get("text"), str)]
        final = texts[-1] if texts else None
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    stripped = final.strip()
    loc = rendered.rfind(stripped)
    if loc < 0:
        raise ChatTemplateError(
            "continue_final_message is set but the chat template does not render the final message's text"
        )
    kept = final.lstrip()
    if rendered[loc : loc + len(kept)] == final:
        return rendered[: loc + len(kept)]
    return rendered[: loc + len(stripped)]


def messages_from_request(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as plain dicts, as transformers' templates expect them.

    Unset (None) fields are left out rather than set to None: templates test `is defined` as
    often as `is none`, and a None would render as "None" under `is defined`. Tool-call arguments
    sent as a JSON object string (OpenAI's wire form) are parsed into objects, as vLLM does, because
    templates render them with `tojson`.
    """
    messages: list[dict[str, Any]] = msgspec.to_builtins(req.messages)
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(function["arguments"])
                except ValueError:
                    continue  # not JSON: the template gets the string as sent
                if isinstance(arguments, dict):
                    function["arguments"] = arguments
    return messages
