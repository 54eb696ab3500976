"""Tokenization for the lean runtime: ``tokenizers`` for the vocabulary, jinja2 for the chat template.

No transformers import: the bundle carries ``tokenizer.json`` and the chat template string.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from .architectures import architecture
from .bundle import BundleManifest, TokenizerInfo
from .errors import BundleError, PromptError
from .tools import TAGS, ToolSpec, generic_messages, template_messages


class TextCodec:
    """Encode prompts (plain or chat), decode tokens, and stream text deltas.

    ``template_variables``: what the chat template may test beyond the messages (a family's templates test
    ``tools``, for one); :meth:`for_bundle` takes them from the bundle's architecture description."""

    def __init__(self, bundle_dir: str | Path, info: TokenizerInfo, template_variables: dict | None = None,
                 tool_call_format: str = ""):
        from tokenizers import Tokenizer

        path = Path(bundle_dir) / info.file
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for unreadable files
            raise BundleError(f"The bundle's tokenizer '{path.name}' cannot be read ({exc}).") from None
        self.info = info
        self.template_variables = dict(template_variables or {})
        self._tool_call_format = tool_call_format  # the family's, where its template renders tools
        self._template = None
        if info.chat_template:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # As transformers' apply_chat_template: an undefined attribute is falsy (Qwen2.5's template tests
            # ``message.tool_calls`` on every assistant message), ``tojson`` keeps key order and non-ASCII.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(info.chat_template)
        self.special_ids = {
            self.tokenizer.token_to_id(t)
            for t in (info.bos_token, info.eos_token)
            if t is not None and self.tokenizer.token_to_id(t) is not None
        }

    @classmethod
    def for_bundle(cls, bundle_dir: str | Path, manifest: BundleManifest) -> TextCodec:
        arch = architecture(name=manifest.model.architecture, where=str(bundle_dir))
        return cls(bundle_dir, manifest.tokenizer, dict(arch.template_variables), arch.tool_call_format)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a request's tools itself (it tests the ``tools`` variable, and the
        family's call format is known); otherwise ``runtime/tools.py`` renders them generically."""
        return bool(self._tool_call_format) and "tools" in (self.info.chat_template or "")

    @property
    def tool_call_format(self) -> str:
        """How answers write tool calls: the family's where the template renders tools, else the generic Hermes."""
        return self._tool_call_format if self.renders_tools else "hermes"

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        """The chat prompt; ``tools`` (OpenAI's function tools) as transformers passes them to the template."""
        if self._template is None:
            raise PromptError("This model has no chat template; pass a plain prompt instead of --chat/messages.")
        if not messages:
            raise PromptError("The messages list is empty.")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PromptError("Each message needs a string 'role' and a string 'content'.")
        from jinja2 import TemplateError

        variables = self.template_variables | ({"tools": list(tools)} if tools else {})
        try:
            return self._template.render(
                **variables,
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.info.bos_token or "",
                eos_token=self.info.eos_token or "",
            )
        except (TemplateError, TypeError, KeyError, IndexError) as exc:
            raise PromptError(f"The chat template cannot render these messages ({exc}).") from None

    @functools.cached_property
    def tool_tag_ids(self) -> dict[str, int]:
        """The tool-call tags the vocabulary holds as added tokens of their own (Qwen's ``<tool_call>``), by id."""
        added = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        return {tag: added[tag] for tag in TAGS if tag in added}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str) or not text:
            raise PromptError("The prompt is empty.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: Sequence[dict], tools: ToolSpec | None = None) -> list[int]:
        """The chat prompt's tokens; OpenAI messages with tool calls and results, and ``tools`` where the request
        shows the model some (``runtime/tools.py``)."""
        # The rendered template already holds its special tokens, as in transformers' apply_chat_template.
        return self.encode(self.render_tool_chat(messages, tools), add_special_tokens=False)

    def render_tool_chat(self, messages: Sequence[dict], tools: ToolSpec | None = None) -> str:
        plain = tools is None and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages
                                          if isinstance(m, dict))
        if plain:
            return self.render_chat(messages)
        msgs = template_messages(messages)
        if self.renders_tools:
            return self.render_chat(msgs, tools=tools.tools if tools is not None and tools.shown else None)
        return self.render_chat(generic_messages(msgs, tools))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a token stream into text deltas without splitting multi-byte characters.

    Decodes only a sliding window (``ids[prefix:]`` against ``ids[prefix:read]``), as TGI and vLLM
    do, so a long generation costs linear time; decoding the window from the same start keeps
    tokenizers that drop a leading space at the start of a decode consistent.
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text

    def push(self, tokens: Iterable[int]) -> str:
        self.ids.extend(int(t) for t in tokens)
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # incomplete UTF-8: wait for more
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise PromptError(f"The chat template rejected the messages: {message}")
