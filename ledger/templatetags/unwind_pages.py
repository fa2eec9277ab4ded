"""Template helpers for the staff pages: times that read as facts.

`{% ago when %}` renders "just now" for the first minute, then "5 minutes ago" (never "0 minutes ago"),
inside a <time> whose title carries the absolute UTC time for whoever needs it exactly.
"""
from datetime import timedelta, timezone as dt_timezone

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince, timeuntil

register = template.Library()
JUST_NOW = timedelta(minutes=1)


def _stamp(when) -> str:
    return when.astimezone(dt_timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def relative(when, now=None) -> str:
    """"just now", "5 minutes ago", "in 2 hours": a person's words for how far `when` is from now."""
    now = now or timezone.now()
    if abs(now - when) < JUST_NOW:
        return "just now"
    if when > now:
        return f"in {timeuntil(when, now, depth=1)}"
    return f"{timesince(when, now, depth=1)} ago"


@register.simple_tag
def ago(when, now=None):
    """A relative time in a <time> element, the absolute time in its title (a tooltip)."""
    if not when:
        return "—"
    return format_html('<time datetime="{}" title="{}">{}</time>', when.isoformat(), _stamp(when), relative(when, now))


@register.simple_tag
def at(when):
    """An absolute time (to the second, UTC) in a <time> element, the relative time in its title."""
    if not when:
        return "—"
    return format_html('<time datetime="{}" title="{}">{}</time>', when.isoformat(), relative(when), _stamp(when))


@register.filter
def breakable(name) -> str:
    """A dotted or snake_case name ("travel.cancel_flight") that may wrap after its dots and underscores on a narrow
    screen, never in the middle of a word: escaped, with <wbr> after each . and _."""
    from django.utils.html import escape
    from django.utils.safestring import mark_safe

    return mark_safe(escape(str(name)).replace(".", ".<wbr>").replace("_", "_<wbr>"))
