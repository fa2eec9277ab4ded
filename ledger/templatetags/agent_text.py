"""`{{ value|agent }}`: what an agent wrote, inert where it is shown (ledger/agent_text.py).

In an HTML template it is escaped with its bidi controls shown; inside `{% autoescape off %}` (the plain-text
emails) every further line is indented and quoted, so agent text cannot start a line of the mail.
"""
from django import template
from django.utils.safestring import mark_safe

from ledger import agent_text

register = template.Library()


@register.filter(needs_autoescape=True)
def agent(value, autoescape=True):
    if autoescape:
        return mark_safe(agent_text.html(value))  # noqa: S308 - escaped by agent_text.html
    return agent_text.mail_text(value)
