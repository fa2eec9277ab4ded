"""The correction trail: what the agent changed for someone, and what became of it, in plain language.

Every statement is derived from the ledger (actions, their snapshots and compensations, the audit
chain); none comes from a prompt or the model's reasoning, so the page can be shown to the person on
whose behalf the agent acted. `correction_trail(run)` is also what the API serves.
"""
from __future__ import annotations

import datetime
import hashlib
import re
import secrets

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.urls import reverse
from django.utils import timezone

from approvals.services import notify, require_role
from ledger import describe
from ledger.audit import event_is_authentic, ledger_transaction
from ledger.errors import NotFound, ValidationFailed
from ledger.models import (
    ActionClass, ActionKind, ActionStatus as A, AuditEvent, CompensationStrategy, Role, Run, RunStatus as R,
)
from recovery.models import TrailShareLink

DEFAULT_SHARE_MAX_AGE = 7 * 24 * 3600
# What secrets.token_urlsafe(32) gives (43 characters); anything else cannot be a link and is not looked up.
SHARE_TOKEN = re.compile(r"^[A-Za-z0-9_-]{43}$")
SUMMARY_ARGS = 3
SUMMARY_VALUE_LENGTH = 60

HAD_EFFECT = {A.SUCCEEDED, A.COMPENSATING, A.COMPENSATED, A.COMPENSATION_FAILED}
IRREVERSIBLE = {ActionClass.EXTERNAL_IRREVERSIBLE}


def correction_trail(run: Run) -> dict:
    """The run's correction trail: a headline and statements (changed|restored|corrected|not_undone|reviewed|pending).

    Written for the person the agent acted for: each step reads in the tool's own words (its policy's `describe`
    sentences) or, without them, in a plain sentence made from its description and target. Tool names, URLs,
    error texts, HTTP statuses and audit event numbers stay on the operator's run page; `audit` (the reference into
    the chain) is for the API and the operator, and the customer's pages leave it out.
    """
    actions = list(run.actions.select_related("tool").order_by("seq"))
    events = list(AuditEvent.objects.filter(run_ref=run.pk, tenant_id=run.tenant_id).order_by("seq"))
    latest_comp = {}
    for action in actions:
        if action.kind == ActionKind.COMPENSATION:
            latest_comp[action.compensates_id] = action  # ordered by seq: the newest attempt at undoing wins
    forward = [a for a in actions if a.kind == ActionKind.FORWARD]
    statements: list[dict] = []

    def say(kind: str, text: str) -> None:
        statements.append({"kind": kind, "text": text})

    for action in forward:
        if action.status in HAD_EFFECT and action.tool.action_class != ActionClass.READ_ONLY:
            say("changed", _effect(action))

    why = _why_corrected(run, events, forward)
    if why:
        say("corrected", why)

    not_undone = 0
    for action in reversed(forward):  # in the order Unwind undoes them: newest first
        comp = latest_comp.get(action.pk)
        step = _step(action)
        irreversible = (action.tool.action_class in IRREVERSIBLE
                        or action.compensation_plan.get("strategy") == CompensationStrategy.CORRECTION)
        if action.status == A.COMPENSATED and comp is not None:
            if irreversible:
                not_undone += 1
                say("not_undone", f"This cannot be taken back: {_quiet(step)}.")
                say("corrected", f"Instead, a correction was made: {_quiet(_step(comp))}.")
            else:
                say("restored", _restored(action, comp))
        elif action.status == A.COMPENSATION_FAILED:
            not_undone += 1
            say("not_undone", f"This could not be undone: {_quiet(step)}. The reason: {_failure_cause(action, comp, events)}.")
        elif action.status == A.COMPENSATING:
            waiting = comp is not None and comp.status == A.AWAITING_APPROVAL
            say("pending", f"Undoing this is {'waiting for a person to approve it' if waiting else 'in progress'}: "
                           f"{_quiet(step)}.")
        elif action.status == A.SUCCEEDED and run.status in (R.COMPENSATED, R.CLOSED, R.NEEDS_ATTENTION, R.UNWINDING) \
                and action.tool.action_class != ActionClass.READ_ONLY and _has_no_undo(action):
            not_undone += 1
            say("not_undone", f"This has no automatic undo and still stands: {_quiet(step)}.")
        elif action.status == A.LOST:
            say("pending", f"We do not know yet whether this happened, and a person has been asked to check: "
                           f"{_quiet(step)}.")

    reviewers = _reviews(events, actions, say)
    if not reviewers:
        if run.status in (R.COMPLETED, R.COMPENSATED):
            say("reviewed", "No person needed to review this: it was handled automatically, by the rules set for it.")
        else:
            say("reviewed", "No person has reviewed this yet.")

    if run.status == R.NEEDS_ATTENTION:
        say("pending", "What is left has been put in front of a person, who will decide how to finish it.")
    elif run.status in (R.RUNNING, R.AWAITING_APPROVAL):
        say("pending", "The work is still in progress, so this account is not final.")
    elif run.status == R.UNWINDING:
        say("pending", "Undoing the changes is in progress.")

    return {
        "run": run.pk,
        "status": run.status,
        "headline": _headline(run, forward, not_undone),
        "statements": statements,
        "reviewed_by": reviewers,
        "audit": _audit(run, events),
    }


def share_max_age() -> int:
    return int(getattr(settings, "UNWIND_TRAIL_LINK_MAX_AGE", DEFAULT_SHARE_MAX_AGE))


# --- share links --------------------------------------------------------------------------------------

def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def trail_share_url(token: str) -> str:
    return reverse("recovery:trail_share", args=[token])


def trail_link_create(*, run: Run, user, sent_to: str = "") -> tuple[TrailShareLink, str]:
    """A new share link to the run's trail (operators only, audited). Returns the link and its token.

    The token is returned once and never stored: only its SHA-256 is. It expires after
    UNWIND_TRAIL_LINK_MAX_AGE seconds, or earlier when an operator revokes it.
    """
    require_role(user, run.tenant_id, Role.OPERATOR)
    token = secrets.token_urlsafe(32)
    actor = f"user:{user.get_username()}"
    with ledger_transaction(run.tenant_id) as audit:
        link = TrailShareLink.objects.create(
            tenant_id=run.tenant_id, run=run, token_hash=_token_hash(token), created_by=actor, sent_to=sent_to,
            expires_at=timezone.now() + datetime.timedelta(seconds=share_max_age()),
        )
        audit.record("trail.link_created", actor=actor, run=run, link=link.pk, expires_at=link.expires_at.isoformat(),
                     sent_to=sent_to)
    return link, token


def trail_link_revoke(*, run: Run, link_id: int, user) -> TrailShareLink:
    """Revoke one of the run's share links (operators only, audited): from now on it answers 404.

    Revoking a link that is already revoked or expired changes nothing and records nothing.
    """
    require_role(user, run.tenant_id, Role.OPERATOR)
    link = TrailShareLink.objects.filter(run=run, pk=link_id).first()
    if link is None:
        raise NotFound(f"run {run.pk} has no share link {link_id}")
    actor = f"user:{user.get_username()}"
    now = timezone.now()
    with ledger_transaction(run.tenant_id) as audit:
        revoked = TrailShareLink.objects.filter(pk=link.pk, revoked_at__isnull=True, expires_at__gt=now).update(
            revoked_at=now, revoked_by=actor)
        if revoked == 1:
            audit.record("trail.link_revoked", actor=actor, run=run, link=link.pk)
    link.refresh_from_db()
    return link


def trail_links_active(run: Run) -> list[TrailShareLink]:
    """The run's links that still open the trail, newest first."""
    return list(TrailShareLink.objects.filter(run=run, revoked_at__isnull=True, expires_at__gt=timezone.now())
                .order_by("-created_at", "-pk"))


def trail_link_open(token: str) -> Run | None:
    """The run a share token opens, or None when no live link has it (unknown, expired or revoked alike)."""
    if not isinstance(token, str) or not SHARE_TOKEN.match(token):
        return None
    now = timezone.now()
    link = (TrailShareLink.objects.select_related("run__tenant")
            .filter(token_hash=_token_hash(token), revoked_at__isnull=True, expires_at__gt=now).first())
    if link is None:
        return None
    TrailShareLink.objects.filter(pk=link.pk).update(last_used_at=now)
    return link.run


def trail_send(*, run: Run, user) -> str:
    """Email a new share link to the trail to the person the run acted for (an operator's decision, audited).

    The email is an outbox row written in the same transaction as the link and the audit events; a worker
    sends it. Returns the address it goes to.
    """
    require_role(user, run.tenant_id, Role.OPERATOR)
    recipient = (run.on_behalf_of or "").strip()
    try:
        validate_email(recipient)
    except ValidationError:
        raise ValidationFailed(f"run {run.pk} acts on behalf of {recipient or 'nobody'!r}, which is not an email "
                               "address; copy the share link instead", field="on_behalf_of") from None
    trail = correction_trail(run)
    with ledger_transaction(run.tenant_id) as audit:
        _, token = trail_link_create(run=run, user=user, sent_to=recipient)
        url = trail_share_url(token)
        notify(tenant_id=run.tenant_id, kind="correction_trail", recipients=[recipient],
               subject=f"What happened to your request (reference {run.pk})", template="recovery/email/correction_trail",
               context={"run": run, "trail": trail, "url": url, "days": share_max_age() // 86400})
        audit.record("trail.sent", actor=f"user:{user.get_username()}", run=run, to=recipient)
    return recipient


# --- wording ----------------------------------------------------------------------------------------
# Every sentence below is for the person the agent acted for: it names what happened to them in the tool's own
# words or in plain ones, never a tool name, URL, error text, HTTP status or audit event number.

def _first_sentence(text: str) -> str:
    text = (text or "").strip()
    return text.split(". ")[0].rstrip(".") if text else ""


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def _quiet(sentence: str) -> str:
    """A sentence set inside another: no final full stop of its own, lower-case start unless it is a name."""
    return _lower_first(sentence.rstrip(". "))


def _human(name: str) -> str:
    return str(name).replace("_", " ").replace("-", " ").strip()


def _short(value) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str) and 0 < len(value) <= SUMMARY_VALUE_LENGTH and value.isprintable():
        return value
    return None


def _args_summary(args, tool) -> str:
    """A few short arguments, in the order the tool's schema requires them (JSON objects keep no order)."""
    if not isinstance(args, dict):
        return ""
    required = [name for name in (tool.args_schema or {}).get("required", []) if name in args]
    parts = []
    for name in [*required, *sorted(set(args) - set(required))]:
        shown = _short(args[name])
        if shown is not None:
            parts.append(f"{_human(name)}: {shown}")
        if len(parts) == SUMMARY_ARGS:
            break
    return f" ({', '.join(parts)})" if parts else ""


def _target(action) -> str:
    return " ".join(p for p in (_human(action.target_type), action.target_id) if p)


def _declared(action, kind: str) -> str | None:
    """The tool's own sentence for this step (its policy's `describe`), or None to fall back to a plain one."""
    template = (action.tool.describe or {}).get(kind) if isinstance(action.tool.describe, dict) else None
    if not template:
        return None
    return describe.render(template, args=action.args, result=action.result, target=action.target_id or "")


def _generic(action) -> str:
    """What the step was, without the tool's own words: its description and arguments, else its target."""
    what = _first_sentence(action.tool.description)
    if what:
        return f"{_lower_first(what)}{_args_summary(action.args, action.tool)}"
    target = _target(action)
    return f"a change to {target}" if target else "a step taken on your behalf"


def _step(action) -> str:
    """The step as a sentence: the tool's `describe.done`, or the plain fallback."""
    return _declared(action, "done") or f"we took this step: {_generic(action)}"


def _fields(tool, *snapshots) -> list[str]:
    """Snapshot fields in the order the tool's policy lists them (JSON objects keep no order)."""
    present = {field for snapshot in snapshots if isinstance(snapshot, dict) for field in snapshot}
    listed = [field for field in (tool.snapshot or {}).get("fields", []) if field in present]
    return [*listed, *sorted(present - set(listed))]


def _changes(action) -> list[str]:
    before, after = action.before, action.after
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    return [f"{_human(field)} from {before.get(field)} to {after.get(field)}" for field in _fields(action.tool, after)
            if field in before and before.get(field) != after.get(field)]


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:]).rstrip(".") + "."


def _effect(action) -> str:
    declared = _declared(action, "done")
    if declared:
        return _sentence(declared)
    target = _target(action)
    changes = _changes(action)
    if changes and target:
        return f"We changed {target}: {', '.join(changes)}."
    return _sentence(f"we took this step: {_generic(action)}")


def _restored(action, comp) -> str:
    declared = _declared(action, "undone")
    if declared:
        return _sentence(declared)
    target = _target(action) or "it"
    if action.compensation_plan.get("strategy") == CompensationStrategy.SNAPSHOT:
        back = [f"{_human(field)} back to {action.before.get(field)}" for field in _fields(action.tool, action.after)
                if isinstance(action.before, dict) and field in action.before
                and action.before.get(field) != (action.after or {}).get(field)]
        if back:
            return f"We restored {target}: {', '.join(back)}."
        return f"We restored {target} to how it was before."
    undo = _declared(comp, "done")
    if undo:
        return _sentence(undo)
    return _sentence(f"we undid this step: {_generic(action)}")


def _has_no_undo(action) -> bool:
    return action.compensation_plan.get("strategy") in (None, "", CompensationStrategy.NONE)


def _failure_cause(action, comp, events) -> str:
    if comp is not None and comp.error_class == "drift":
        current = next((e.data.get("current") for e in reversed(events)
                        if e.action_ref == comp.pk and e.kind == "compensation.failed" and "current" in e.data), None)
        current = current if isinstance(current, dict) else {}
        now = [f"{_human(field)} is now {current[field]}" for field in _fields(action.tool, current)
               if isinstance(action.after, dict) and action.after.get(field) != current[field]]
        detail = f" ({', '.join(now)})" if now else ""
        return (f"someone else changed it after the agent did{detail}, and their change was kept rather than "
                f"overwritten")
    if comp is not None and comp.status == A.REJECTED:
        return f"a person decided not to undo it: {comp.decision_reason or 'no reason given'}"
    if comp is not None and comp.status == A.EXPIRED:
        return "nobody approved undoing it in time"
    return "undoing it did not succeed, and a person has been told"


def _why_corrected(run, events, forward) -> str:
    """Why the run was unwound, from the audit chain and the steps: a failed or declined step, a cancellation."""
    started = next((e for e in events if e.kind == "run.unwinding"), None)
    if started is None:
        return ""
    who = started.actor
    if who.startswith("user:"):
        reason = started.data.get("reason") or ""
        if reason:
            return f"Why it was corrected: {who[5:]} decided to undo it ({reason})."
        cancelled = next((e for e in events if e.kind == "run.cancel_requested" and e.actor == who), None)
        if cancelled is not None:
            note = cancelled.data.get("reason")
            return f"Why it was corrected: {who[5:]} cancelled it{f' ({note})' if note else ''}."
        return f"Why it was corrected: {who[5:]} decided to undo it."
    if who.startswith("agent:") and any(e.kind == "run.cancel_requested" for e in events):
        return "Why it was corrected: the agent stopped before it finished."
    stopped = next((a for a in reversed(forward) if a.status in (A.FAILED, A.REJECTED, A.EXPIRED)), None)
    if stopped is None:
        return "Why it was corrected: a step could not be completed."
    if stopped.status == A.REJECTED:
        reason = f" ({stopped.decision_reason})" if stopped.decision_reason else ""
        return f"Why it was corrected: a person declined this step{reason}: {_quiet(_step(stopped))}."
    if stopped.status == A.EXPIRED:
        return f"Why it was corrected: nobody approved this step in time: {_quiet(_step(stopped))}."
    failed = _declared(stopped, "failed")
    if failed:
        return f"Why it was corrected: {_quiet(failed)}."
    return f"Why it was corrected: this step could not be completed: {_generic(stopped)}."


def _reviews(events, actions, say) -> list[str]:
    """Statements for each human decision in the audit chain; returns who made them, in order."""
    by_id = {a.pk: a for a in actions}
    people: list[str] = []
    for event in events:
        if not event.actor.startswith("user:"):
            continue
        person = event.actor[5:]
        action = by_id.get(event.action_ref)
        reason = event.data.get("reason") or ""
        tail = f" on {event.created_at:%Y-%m-%d %H:%M} UTC" + (f" ({reason})" if reason else "")
        if event.kind in ("approval.approve", "approval.reject") and action is not None:
            verb = "approved" if event.kind == "approval.approve" else "declined"
            undone = by_id.get(action.compensates_id) if action.kind == ActionKind.COMPENSATION else None
            what, step = ("undoing this step", undone) if undone is not None else ("this step", action)
            say("reviewed", f"{person} reviewed and {verb} {what}{tail}: {_quiet(_step(step))}.")
        elif event.kind == "run.running" and event.data.get("status_from") == R.NEEDS_ATTENTION:
            say("reviewed", f"{person} reviewed it and had the work resumed{tail}.")
        elif event.kind == "run.unwinding" and "why" not in event.data:  # a cancel says so once, above
            say("reviewed", f"{person} reviewed it and had it undone{tail}.")
        elif event.kind == "run.closed":
            say("reviewed", f"{person} reviewed it and closed it as handled{tail}.")
        elif event.kind == "run.cancel_requested":
            say("reviewed", f"{person} cancelled it{tail}.")
        else:
            continue
        if person not in people:
            people.append(person)
    return people


def _headline(run, forward, not_undone: int) -> str:
    changed = any(a.status in HAD_EFFECT for a in forward)
    if run.status == R.COMPLETED:
        return "The agent finished the task; nothing needed to be corrected."
    if run.status == R.COMPENSATED:
        if not changed:
            return "The agent's task was stopped before it changed anything."
        if not_undone:
            return (f"The agent's changes were undone, except {not_undone} that could not be taken back "
                    f"and {'was' if not_undone == 1 else 'were'} corrected instead.")
        return "Everything the agent changed has been undone."
    if run.status == R.CLOSED:
        return "A person reviewed this run and closed it; the statements below say what stands."
    if run.status == R.NEEDS_ATTENTION:
        return "Some of the agent's changes could not be undone automatically; a person is deciding what to do."
    if run.status == R.UNWINDING:
        return "The agent's changes are being undone."
    return "The agent is still working on this task."


def _audit(run, events) -> dict:
    verified = all(event_is_authentic(e) for e in events)
    span = f", events #{events[0].seq} to #{events[-1].seq}" if events else ""
    return {
        "events": len(events),
        "verified": verified,
        "reference": f"Unwind audit chain of tenant {run.tenant.slug}, run {run.pk}{span}",
    }
