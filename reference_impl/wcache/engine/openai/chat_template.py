"""The chat template: where it comes from, and how it turns messages into a prompt.

Where, in vLLM's order: ``--chat-template`` (a file, or the template text itself when no such file
exists and the value holds ``{``, ``}`` or a newline, as vLLM decides), else the checkpoint's own:
``chat_template.jinja``, else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list
of named templates of which ``default`` is taken), the files and precedence transformers uses.
Without any, chat requests get the 400 that names ``--chat-template``.

How, as transformers renders it (``apply_chat_template``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, its ``tojson``
filter, the globals ``raise_exception`` and ``strftime_now``, and the variables ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``. A template is untrusted code (it comes
with a downloaded checkpoint): the sandbox keeps it from reaching Python's internals. The template
is compiled at start, so a broken one stops ``wcache serve`` before its weights load.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wcache.engine.openai import template_sandbox
from wcache.errors import CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_SYNTAX, CHAT_TEMPLATE_CONFIG, UserError
from wcache.model.tokenizer import special_text

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
JINJA_CHARS = "{}\n"  # vLLM: a --chat-template value with one of these is the template, not a path


class ChatTemplateError(UserError):
    pass


class RenderError(Exception):
    """The template refused the messages (its ``raise_exception``) or broke while rendering."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # where it came from, for the start-up log line
    text: str
    bos_token: str = ""  # tokenizer_config.json's; a template sees "" where the tokenizer has none
    eos_token: str = ""

    def __post_init__(self):
        check_syntax(self.text, self.source)  # compiled and rendered only in a render worker

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Rendered by a render worker, under a deadline and a memory bound (template_sandbox.py)."""
        variables = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return template_sandbox.RUNNER.render(self.text, self.source, variables)
        except template_sandbox.SandboxError as e:
            raise RenderError(str(e)) from None


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: jinja's tojson escapes HTML characters, which a prompt must not see
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def render_compiled(template: jinja2.Template, variables: dict) -> str:
    """Render in this process: the render worker's side of ``ChatTemplate.render``."""
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:  # raise_exception, an undefined call, a sandbox refusal
        raise RenderError(str(e) or type(e).__name__) from None
    except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:
        raise RenderError(f"{type(e).__name__}: {e}") from None


def _environment() -> ImmutableSandboxedEnvironment:
    # optimized=False: no constant folding by jinja's optimizer (the render worker compiles anyway)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                                        optimized=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _syntax_error(e: jinja2.TemplateSyntaxError, source: str) -> ChatTemplateError:
    return ChatTemplateError(CHAT_TEMPLATE_SYNTAX.format(source=source, line=e.lineno, error=e.message))


def check_syntax(text: str, source: str) -> None:
    """Parse only, in this process: a syntax error stops start-up. Parsing is linear in the text;
    compiling is not safe here, since jinja computes constant expressions as it generates code
    (`"x" * 10**9`: 45 s and 3.8 GB), so only a render worker compiles (template_sandbox.py)."""
    try:
        _environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise _syntax_error(e, source) from None


def compile_template(text: str, source: str) -> jinja2.Template:
    """Compile: the render worker's side, under its limits."""
    try:
        return _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise _syntax_error(e, source) from None


def from_flag(value: str) -> tuple[str, str]:
    """(source, text) of a ``--chat-template`` value: a file's contents, else the value itself if it
    looks like a template (escapes such as ``\\n`` decoded, as vLLM does), else the file error."""
    try:
        return value, Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if any(c in value for c in JINJA_CHARS):
            return "--chat-template (inline)", codecs.decode(value, "unicode_escape")
        raise ChatTemplateError(CHAT_TEMPLATE_FILE.format(value=value, reason=e)) from None


def _read_config(model_dir: Path) -> dict:
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(CHAT_TEMPLATE_CONFIG.format(path=path, why=f"not readable JSON: {e}")) from None
    if not isinstance(config, dict):
        raise ChatTemplateError(CHAT_TEMPLATE_CONFIG.format(path=path, why="not a JSON object"))
    return config


def _from_config(config: dict, path: Path) -> str | None:
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):  # transformers' list of named templates: the default one
        for entry in t:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
        return None
    raise ChatTemplateError(CHAT_TEMPLATE_CONFIG.format(path=path, why="chat_template is neither text nor a list "
                                                                        "of named templates"))


def load(model_dir: str, flag: str | None = None) -> ChatTemplate | None:
    """The template chat requests are rendered with, or None when there is none. ``model_dir``: where
    the tokenizer's files are (the model directory, or ``--tokenizer``'s)."""
    d = Path(model_dir)
    config = _read_config(d)
    specials = dict(bos_token=special_text(config, "bos_token") or "",
                    eos_token=special_text(config, "eos_token") or "")
    if flag is not None:
        source, text = from_flag(flag)
        return ChatTemplate(source, text, **specials)
    jinja = d / TEMPLATE_FILE
    if jinja.is_file():
        try:
            return ChatTemplate(str(jinja), jinja.read_text(encoding="utf-8"), **specials)
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(CHAT_TEMPLATE_FILE.format(value=jinja, reason=e)) from None
    text = _from_config(config, d / TOKENIZER_CONFIG)
    return None if text is None else ChatTemplate(str(d / TOKENIZER_CONFIG), text, **specials)
