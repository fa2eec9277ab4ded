"""`{{ request.action|amounts }}`: what a request is about, in money ("€610.00"), for a list row.

The one rule is approvals/surfaces.py's `amounts` (an undo is about the amounts of the step it undoes); this only
lets a template ask it.
"""
from django import template

from approvals import surfaces

register = template.Library()


@register.filter
def amounts(action) -> str:
    return ", ".join(surfaces.amounts(action))
