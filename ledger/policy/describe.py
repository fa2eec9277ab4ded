"""A tool's own words for what a step did: the `describe` templates of its policy, and their sandboxed formatter.

A tool may declare how its steps read to the person the agent acted for:

    describe:
      done: "We booked {args.hotel} for {args.nights} nights"
      undone: "We cancelled the booking at {args.hotel}"
      failed: "We could not book {args.hotel}"

The correction trail shows these sentences instead of internals (tool names, URLs, error texts). A template is
written by a tenant admin but read by customers, so it is held to a tiny grammar rather than `str.format`:
placeholders are exactly `{args.<name>}`, `{result.<name>}` or `{target}`; a name is a plain key (letters,
digits, `_`, `-`, not starting with `_`), looked up in a dict, never as an attribute; there are no format specs,
conversions, indexes or nesting; `{{` and `}}` are literal braces. Anything else is refused when the policy is
written (`check`), and a template that slipped past (an edited row) renders as nothing (`render` → None), so
the caller's plain fallback sentence is shown. A placeholder whose value is missing, not a short scalar or
multi-line also makes `render` return None: a sentence is shown whole or not at all.
"""
from __future__ import annotations

import math
import re

KINDS = ("done", "undone", "failed")
MAX_TEMPLATE_LENGTH = 300
MAX_VALUE_LENGTH = 80
NAME = r"[A-Za-z][A-Za-z0-9_-]{0,63}"
PLACEHOLDER = re.compile(rf"^(?:(args|result)\.({NAME})|(target))$")
TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


# "your card", "you": a relation the sentence cannot know. The run's steps may act for someone other than whoever
# reads the trail (an agent charges customer acme-corp for Carol), so a sentence names the party from an argument.
SECOND_PERSON = re.compile(r"\b(?:you|your|yours|yourself)\b", re.IGNORECASE)


class TemplateError(ValueError):
    """A describe template outside the grammar; the message says what is wrong, `field` which key it is about."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def _parts(template: str) -> list[tuple[str, str | None, str | None]]:
    """The template as ("text", literal, None) and ("field", source, name) parts, or TemplateError."""
    parts: list[tuple[str, str | None, str | None]] = []
    position = 0
    for match in TOKEN.finditer(template):
        if match.start() > position:
            parts.append(("text", template[position:match.start()], None))
        token = match.group(0)
        if token in ("{{", "}}"):
            parts.append(("text", token[0], None))
        elif match.group(1) is None:
            raise TemplateError(f"has an unmatched {token!r} (write {token * 2} for a literal brace)")
        else:
            field = PLACEHOLDER.match(match.group(1))
            if field is None:
                shown = match.group(1)[:40]
                raise TemplateError(f"{{{shown}}} is not a placeholder: use {{args.<name>}}, {{result.<name>}} or "
                                    "{target}, with no format spec, index or attribute")
            source, name, target = field.groups()
            parts.append(("field", "target", None) if target else ("field", source, name))
        position = match.end()
    if position < len(template):
        parts.append(("text", template[position:], None))
    return parts


def check(describe, *, where: str, arg_names: set[str] | None = None) -> dict:
    """Validate a policy's `describe` object and return it; TemplateError names the key at fault.

    `arg_names`, when the tool's schema lists its properties, catches a misspelt `{args.x}` at write time.
    """
    if not isinstance(describe, dict):
        raise TemplateError(f"must be an object with done, undone and/or failed, not {type(describe).__name__}", where)
    unknown = sorted(set(describe) - set(KINDS))
    if unknown:
        raise TemplateError(f"is not a describe key (known: {', '.join(KINDS)})", f"{where}.{unknown[0]}")
    for kind, template in describe.items():
        at = f"{where}.{kind}"
        if not isinstance(template, str) or not template.strip():
            raise TemplateError("must be a sentence (a non-empty string)", at)
        if len(template) > MAX_TEMPLATE_LENGTH or "\n" in template or "\r" in template:
            raise TemplateError(f"must be one line of at most {MAX_TEMPLATE_LENGTH} characters", at)
        try:
            parts = _parts(template)
        except TemplateError as why:
            raise TemplateError(str(why), at) from None
        if any(part == "text" and SECOND_PERSON.search(source) for part, source, _ in parts):
            raise TemplateError("must not say “you” or “your”: the person who reads the trail may not be the one the "
                                "step acted on (a card, an account); name them from an argument, such as "
                                "{args.customer}, or leave the relation out", at)
        for part, source, name in parts:
            if part == "field" and source == "args" and arg_names is not None and name not in arg_names:
                raise TemplateError(f"{{args.{name}}} is not one of the tool's arguments "
                                    f"({', '.join(sorted(arg_names)) or 'it has none'})", at)
    return describe


def _shown(value) -> str | None:
    """A value fit for a sentence: a short one-line string or a finite number; anything else is not shown."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value) if abs(value) < 10**15 else None
    if isinstance(value, float):
        return f"{value:g}" if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip()
        if 0 < len(text) <= MAX_VALUE_LENGTH and text.isprintable():
            return text
    return None


def render(template, *, args, result, target: str = "") -> str | None:
    """The sentence, or None when the template is not valid or a value it names cannot be shown."""
    if not isinstance(template, str):
        return None
    try:
        parts = _parts(template)
    except TemplateError:
        return None
    sources = {"args": args if isinstance(args, dict) else {}, "result": result if isinstance(result, dict) else {}}
    out = []
    for part, source, name in parts:
        if part == "text":
            out.append(source)
            continue
        value = _shown(target) if source == "target" else _shown(sources[source].get(name))
        if value is None:
            return None
        out.append(value)
    sentence = "".join(out).strip()
    return sentence or None
