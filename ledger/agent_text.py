"""What an agent wrote, made inert for each surface it is shown on.

Everything an agent sends (argument names and values, `target`, `on_behalf_of`, its intent's goal and reasoning,
the run's goal) is data to the person who reads it, never the surface's own markup:

- every surface: bidirectional-text controls (U+202E RIGHT-TO-LEFT OVERRIDE and the rest) are shown as visible
  markers (`[U+202E]`) instead of reordering what follows, so "invoice‮fdp.exe" cannot read as "invoiceexe.pdf";
- HTML (pages, the HTML part of an email): escaped as Django escapes, through the `agent` template filter, its
  line breaks plain newlines;
- the text part of an email: each line after the first is indented and starts with "| ", so a newline in agent
  text can never start a line of its own ("Approve: https://..." reads as the agent's, under its label);
- Slack mrkdwn: `&`, `<` and `>` escaped as Slack asks, so `<!channel>`, `<@U0BEN>` and
  `<https://evil.example|Verified by Finance>` are text, not mentions or links.

Unwind's own words never go through these; the agent's always do, on every surface, through this module.
"""
from __future__ import annotations

import re

from django.utils.html import escape

# Embedding, override and isolate controls, and the implicit marks (LRM, RLM, ALM).
BIDI_CONTROLS = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Every line break str.splitlines knows. Mail servers break lines only at CRLF, so a U+2028 kept in an HTML part
# hides a line past SMTP's 998 characters from Django's check, and the mail is refused ("Line too long").
LINE_BREAKS = re.compile("\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")
TEXT_CONTINUATION = "\n        | "


def neutral(value) -> str:
    """The text with each bidi control shown as a visible marker instead of acting on the text after it."""
    return BIDI_CONTROLS.sub(lambda found: f"[U+{ord(found.group()):04X}]", "" if value is None else str(value))


def html(value) -> str:
    """For HTML: escaped, bidi controls shown, every kind of line break a plain newline (the caller marks the
    result safe)."""
    return escape(LINE_BREAKS.sub("\n", neutral(value)))


def mail_text(value) -> str:
    """For a plain-text email, after a label on the same line: every further line (any of the line breaks
    str.splitlines knows, CR, U+2028 and the rest included) is indented and quoted with "| "."""
    lines = neutral(value).splitlines() or [""]
    return TEXT_CONTINUATION.join(lines)


def slack(value) -> str:
    """For Slack mrkdwn: &, < and > escaped (Slack's three control characters), bidi controls shown."""
    return neutral(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_quote(value) -> str:
    """Agent prose for Slack: escaped, each line in a quote block, so it reads as quoted words."""
    return "\n".join(f">{line}" for line in (slack(value).splitlines() or [""]))
