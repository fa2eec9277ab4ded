"""The correction trail: what the agent changed for someone, and what became of it, in plain language.

Every statement is derived from the ledger (actions, their snapshots and compensations, the audit
chain); none comes from a prompt or the model's reasoning, so the page can be shown to the person on
whose behalf the agent acted. `correction_trail(run)` is also what the API serves.

Longer than 500 lines: every sentence the trail says, for every outcome of a step (done, declined, undone,
unknown), sits in this one module so that a reader checks them side by side against each other.
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
from ledger.policy import describe
from ledger.audit.chain import event_is_authentic, ledger_transaction
from ledger.db.partitions import recent
from ledger.policy.display import display_value, money_source_args, person_at, shown_args
from ledger.errors import NotFound, ValidationFailed
from ledger.models import (
    ActionClass, ActionKind, ActionStatus as A, AuditEvent, CompensationStrategy, ErasedRun, Role, Run,
    RunStatus as R,
)
from recovery.models import TrailShareLink

DEFAULT_SHARE_MAX_AGE = 7 * 24 * 3600
# What secrets.token_urlsafe(32) gives (43 characters); anything else cannot be a link and is not looked up.
SHARE_TOKEN = re.compile(r"^[A-Za-z0-9_-]{43}$")
SUMMARY_ARGS = 3
SUMMARY_VALUE_LENGTH = 60

HAD_EFFECT = {A.SUCCEEDED, A.COMPENSATING, A.COMPENSATED, A.COMPENSATION_FAILED}
# Steps that ended without touching anything: declined, expired, failed (the tool turned it down or never took it),
# cancelled before they ran. They read as what was asked, never in the words of a done step.
NOT_DONE = {A.REJECTED, A.EXPIRED, A.FAILED, A.SKIPPED}
STOPPED_BY = {A.FAILED: "could not be completed", A.REJECTED: "was declined", A.EXPIRED: "was not approved in time"}
# A value made only of an identifier's characters with an underscore (cus_carol, lic_3f2a) or a long hex or
# UUID: an internal id the customer does not know, so a plain sentence leaves it out.
INTERNAL_ID = re.compile(r"^(?:[A-Za-z]+_[A-Za-z0-9_]+|[0-9a-fA-F-]{16,})$")
IRREVERSIBLE = {ActionClass.EXTERNAL_IRREVERSIBLE}


def correction_trail(run: Run, *, actions: list | None = None, events: list | None = None) -> dict:
    """The run's correction trail: a headline and statements
    (changed|not_done|restored|corrected|not_undone|reviewed|pending).

    Written for the person the agent acted for: each step reads in the tool's own words (its policy's `describe`
    sentences, amounts as money) or, without them, in a plain sentence made from its description. A step that had
    no effect is never told in the words of a done one: it reads as what was asked, and why it was not done. People
    are named by their role and the company ("a reviewer at Demo Company"), never by their login. Tool names, ids,
    URLs, error texts, HTTP statuses and audit event numbers stay on the operator's run page; `audit` (the reference
    into the chain) is for the API and the operator, and the customer's pages leave it out.

    An archived run (ledger/archive/reader.py) passes its steps and events, read from its segment.
    """
    if actions is None:
        actions = list(run.actions.select_related("tool").order_by("seq"))
    if events is None:
        events = list(AuditEvent.objects.filter(run_ref=run.pk, tenant_id=run.tenant_id,
                                              created_at__gte=recent(run.created_at)).order_by("seq"))
    company = run.tenant.name
    latest_comp = {}
    for action in actions:
        if action.kind == ActionKind.COMPENSATION:
            latest_comp[action.compensates_id] = action  # ordered by seq: the newest attempt at undoing wins
    forward = [a for a in actions if a.kind == ActionKind.FORWARD and a.tool.action_class != ActionClass.READ_ONLY]
    declines = {e.action_ref: e for e in events if e.kind == "approval.reject"}
    statements: list[dict] = []

    def say(kind: str, text: str) -> None:
        statements.append({"kind": kind, "text": text})

    for action in forward:
        if action.status in HAD_EFFECT:
            say("changed", _effect(action))
        elif action.status in NOT_DONE:
            say("not_done", _not_done(action, declines.get(action.pk), company))

    why = _why_corrected(run, events, forward, company)
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
                # The step's own "undone" sentence names what was corrected (the refund of €10.01); the correcting
                # tool's own sentence ("we refunded a card charge") cannot say which.
                correction = _declared(action, "undone") or _step(comp)
                say("corrected", f"Instead, a correction was made: {_quiet(correction)}.")
            else:
                say("restored", _restored(action, comp) + _overwritten(action, events, company))
        elif action.status == A.COMPENSATION_FAILED:
            not_undone += 1
            say("not_undone", f"This could not be undone: {_quiet(step)}. "
                              f"The reason: {_failure_cause(action, comp, events, company)}.")
        elif action.status == A.COMPENSATING:
            waiting = comp is not None and comp.status == A.AWAITING_APPROVAL
            say("pending", f"Undoing this is {'waiting for a person to approve it' if waiting else 'in progress'}: "
                           f"{_quiet(step)}.")
        elif action.status == A.SUCCEEDED and run.status in (R.COMPENSATED, R.CLOSED, R.NEEDS_ATTENTION, R.UNWINDING) \
                and _has_no_undo(action):
            not_undone += 1
            say("not_undone", f"This has no automatic undo and still stands: {_quiet(step)}.")
        elif action.status == A.HELD:
            can_stop = " You can stop it on this page until then." if (action.tool.hold or {}).get(
                "customer_can_stop") else ""
            say("pending", f"This step is waiting and will be taken at {action.next_attempt_at:%Y-%m-%d %H:%M:%S} UTC "
                           f"unless it is stopped before: {_proposed(action)}.{can_stop}")
        elif action.status == A.LOST:
            say("pending", f"We do not know yet whether this step was taken, and a person has been asked to check: "
                           f"{_proposed(action)}.")

    reviewers = _reviews(events, actions, say, company)
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
        "headline": _headline(run, forward, not_undone, company),
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
    link = _link_create(run=run, token=token, actor=f"user:{user.get_username()}", sent_to=sent_to)
    return link, token


def new_share_link(*, run: Run, actor: str, sent_to: str) -> str:
    """A share link made by the system itself (a held step's notice to the person it acts for); its token."""
    token = secrets.token_urlsafe(32)
    _link_create(run=run, token=token, actor=actor, sent_to=sent_to)
    return token


def _link_create(*, run: Run, token: str, actor: str, sent_to: str) -> TrailShareLink:
    with ledger_transaction(run.tenant_id) as audit:
        link = TrailShareLink.objects.create(
            tenant_id=run.tenant_id, run=run, token_hash=_token_hash(token), created_by=actor, sent_to=sent_to,
            expires_at=timezone.now() + datetime.timedelta(seconds=share_max_age()),
        )
        audit.record("trail.link_created", actor=actor, run=run, link=link.pk, expires_at=link.expires_at.isoformat(),
                     sent_to=sent_to)
    return link


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


def trail_archived_open(token: str):
    """The archived run a share token opens (ledger/archive/reader.py), or None: a link archived with its run opens
    it as long as it would have (until it expires; a link revoked before its run was archived stays revoked)."""
    if not isinstance(token, str) or not SHARE_TOKEN.match(token):
        return None
    from ledger.archive.reader import archived_row

    found = archived_row(TrailShareLink._meta.label_lower, _token_hash(token))
    if found is None:
        return None
    view, link = found
    expires = datetime.datetime.fromisoformat(link["expires_at"])
    if link.get("revoked_at") or expires <= timezone.now():
        return None
    return view


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


def trail_link_erased(token: str):
    """When a share token is one of a run whose person's data was erased (recovery/erasure.py), the day it was: the
    link answers 410 with that, not the unknown link's 404."""
    if not isinstance(token, str) or not SHARE_TOKEN.match(token):
        return None
    return ErasedRun.objects.filter(run__trail_share_links__token_hash=_token_hash(token)).values_list(
        "erased_at", flat=True).first()


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
    if (isinstance(value, str) and 0 < len(value) <= SUMMARY_VALUE_LENGTH and value.isprintable()
            and not INTERNAL_ID.match(value)):
        return value
    return None


def _args_summary(args, tool) -> str:
    """A few short arguments, in the order the tool's schema requires them (JSON objects keep no order).

    An amount reads as money and by itself ("€920.00", not "amount cents: 92000"), its currency argument is not
    repeated, and internal ids are left out.
    """
    if not isinstance(args, dict):
        return ""
    display = tool.display or {}
    skip = money_source_args(display)
    required = [name for name in (tool.args_schema or {}).get("required", []) if name in args]
    parts = []
    for name in [*required, *sorted(set(args) - set(required))]:
        if name in skip:
            continue
        money = display_value(display, name, args[name], args)
        if money is not None:
            parts.append(money)
        elif name not in display and (shown := _short(args[name])) is not None:
            parts.append(f"{_human(name)}: {shown}")
        if len(parts) == SUMMARY_ARGS:
            break
    return f" ({', '.join(parts)})" if parts else ""


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _declared(action, kind: str) -> str | None:
    """The tool's own sentence for this step (its policy's `describe`), amounts as money, or None to fall back."""
    template = (action.tool.describe or {}).get(kind) if isinstance(action.tool.describe, dict) else None
    if not template:
        return None
    return describe.render(template, args=shown_args(action.args, action.tool.display or {}), result=action.result,
                           target=action.target_id or "")


def _proposed(action) -> str:
    """What the step was asked to do, as a verb phrase that claims nothing happened ("charge a customer's card
    (€920.00)"): its description and short arguments, else the kind of thing it would have changed."""
    what = _first_sentence(action.tool.description)
    if what:
        return f"{_lower_first(what)}{_args_summary(action.args, action.tool)}"
    kind = _human(action.target_type)
    return f"a change to {_a(kind)}" if kind else "a step on your behalf"


def _step(action) -> str:
    """The step as a done sentence: the tool's `describe.done`, or the plain fallback. Only for steps with an effect."""
    return _declared(action, "done") or f"we took this step: {_proposed(action)}"


def _fields(tool, *snapshots) -> list[str]:
    """Snapshot fields in the order the tool's policy lists them (JSON objects keep no order)."""
    present = {field for snapshot in snapshots if isinstance(snapshot, dict) for field in snapshot}
    listed = [field for field in (tool.snapshot or {}).get("fields", []) if field in present]
    return [*listed, *sorted(present - set(listed))]


def _value(action, field, value) -> str:
    """A snapshot value as a person reads it: money when the tool's display hint names the field."""
    return display_value(action.tool.display or {}, field, value, action.args or {}) or str(value)


def _changes(action) -> list[str]:
    before, after = action.before, action.after
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    return [f"{_human(field)} from {_value(action, field, before.get(field))} to {_value(action, field, after.get(field))}"
            for field in _fields(action.tool, after) if field in before and before.get(field) != after.get(field)]


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:]).rstrip(".") + "."


def _thing(action) -> str:
    """What a step changed: "ticket T-5035" when its id is one a person knows, "the license" when it is internal."""
    kind = _human(action.target_type)
    if kind and action.target_id and _short(action.target_id) is not None:
        return f"{kind} {action.target_id}"
    return f"the {kind}" if kind else "it"


def _effect(action) -> str:
    declared = _declared(action, "done")
    if declared:
        return _sentence(declared)
    changes = _changes(action)
    if changes and action.target_type:
        return f"We changed {_thing(action)}: {', '.join(changes)}."
    return _sentence(f"we took this step: {_proposed(action)}")


def _restored(action, comp) -> str:
    declared = _declared(action, "undone")
    if declared:
        return _sentence(declared)
    thing = _thing(action)
    if action.compensation_plan.get("strategy") == CompensationStrategy.SNAPSHOT:
        back = [f"{_human(field)} back to {_value(action, field, action.before.get(field))}"
                for field in _fields(action.tool, action.after)
                if isinstance(action.before, dict) and field in action.before
                and action.before.get(field) != (action.after or {}).get(field)]
        if back:
            return f"We restored {thing}: {', '.join(back)}."
        return f"We restored {thing} to how it was before."
    undo = _declared(comp, "done")
    if undo:
        return _sentence(undo)
    return _sentence(f"we undid this step: {_proposed(action)}")


def _overwritten(action, events, company: str) -> str:
    """For an undo a person forced over someone else's later change (drift): what of theirs it overwrote, and who
    decided. "" for an undo that overwrote nothing."""
    if not (action.compensation_plan or {}).get("force"):
        return ""
    current = _drifted(action, events)
    theirs = [f"{_human(field)}: {_value(action, field, current[field])}" for field in _fields(action.tool, current)
              if isinstance(action.after, dict) and action.after.get(field) != current[field]]
    what = f" ({', '.join(theirs)})" if theirs else ""
    return (f" This replaced a later change someone else had made{what}: {person_at('operator', company)} "
            "decided to overwrite it.")


def _drifted(action, events) -> dict:
    """What the target held when an undo of `action` refused to overwrite it (the drift check's reading)."""
    undos = {e.action_ref for e in events if e.kind == "compensation.proposed" and e.data.get("compensates") == action.pk}
    current = next((e.data.get("current") for e in reversed(events)
                    if e.kind == "compensation.failed" and "current" in e.data
                    and (e.action_ref in undos or not undos)), None)
    return current if isinstance(current, dict) else {}


def _has_no_undo(action) -> bool:
    return action.compensation_plan.get("strategy") in (None, "", CompensationStrategy.NONE)


def _when(event) -> str:
    return f"on {event.created_at:%Y-%m-%d %H:%M} UTC"


def _not_done(action, declined, company: str) -> str:
    """The sentence for a step that ended without an effect: what was asked, and why it was not done."""
    asked = _proposed(action)
    if action.status == A.REJECTED:
        reason = f" ({action.decision_reason})" if action.decision_reason else ""
        who = person_at("approver", company) if declined is None or declined.actor.startswith("user:") else "the rules"
        when = f" {_when(declined)}" if declined is not None else ""
        return _sentence(f"{who} declined this step{when}{reason}, so it was not taken: {asked}")
    if action.status == A.EXPIRED:
        return f"Nobody approved this step in time, so it was not taken: {asked}."
    if action.status == A.SKIPPED and action.stopped_by:
        who = {"customer": "You", "agent": "The assistant"}.get(action.stopped_by) \
            or person_at(action.stopped_by, company)
        return _sentence(f"{who} stopped this step while it was waiting, so it was never taken: {asked}")
    if action.status == A.SKIPPED:
        return f"This step was called off before it was taken: {asked}."
    failed = _declared(action, "failed")
    if failed:
        return _sentence(failed)
    return f"This step could not be completed: {asked}."


def _failure_cause(action, comp, events, company: str) -> str:
    if comp is not None and comp.error_class == "drift":
        current = _drifted(action, events)
        now = [f"{_human(field)} is now {_value(action, field, current[field])}"
               for field in _fields(action.tool, current)
               if isinstance(action.after, dict) and action.after.get(field) != current[field]]
        detail = f" ({', '.join(now)})" if now else ""
        return (f"someone else changed it after the agent did{detail}, and their change was kept rather than "
                f"overwritten")
    if comp is not None and comp.status == A.REJECTED:
        return f"{person_at('approver', company)} decided not to undo it: {comp.decision_reason or 'no reason given'}"
    if comp is not None and comp.status == A.EXPIRED:
        return "nobody approved undoing it in time"
    return "undoing it did not succeed, and a person has been told"


def _why_corrected(run, events, forward, company: str) -> str:
    """Why the run was unwound, when it had changed something: the cause its `run.unwinding` event records (a typed
    fact, ledger/engine/runstate.py UNWIND_CAUSES), told for who decided. A run that changed nothing was not
    corrected: its steps say why they were not taken, and nothing more."""
    started = next((e for e in events if e.kind == "run.unwinding"), None)
    if started is None or not any(a.status in HAD_EFFECT for a in forward):
        return ""
    cause, data = _unwind_cause(started, events, forward), started.data
    person = person_at("operator", company)
    note = data.get("reason") or ""
    then = "so we began undoing the changes made before it"
    if cause == "stopped":
        by = data.get("by") or next((a.stopped_by for a in forward if a.stopped_by), "")
        who = {"customer": "you", "agent": "the assistant"}.get(by) or person_at(by, company)
        return f"Why it was corrected: {who} stopped a later step before it was taken, {then}."
    if cause == "cancelled":
        cancelled = next((e for e in events if e.kind == "run.cancel_requested"), None)
        reason = cancelled.data.get("reason") if cancelled is not None else ""
        if cancelled is not None and cancelled.actor.startswith("user:"):
            return f"Why it was corrected: {person} cancelled it{f' ({reason})' if reason else ''}."
        return "Why it was corrected: the agent stopped before it finished."
    if cause == "operator":
        return f"Why it was corrected: {person} decided to undo it{f' ({note})' if note else ''}."
    return "Why it was corrected: " + {
        "failed": f"a later step could not be completed, {then}.",
        "rejected": f"{person_at('approver', company)} declined a later step, {then}.",
        "expired": f"a later step was not approved in time, {then}.",
        "voided": f"the rules for a later step changed before it was approved, {then}.",
        "idle": "the assistant stopped working on it before it finished, so we began undoing the changes it had made; "
                "nothing had failed.",
    }[cause]


def consequence_words(move, *, doing: str) -> str:
    """What else a move does besides its own step, for the person the run acted for ("Stopping it also undoes what
    was done before it: we booked flight TP101 …"), from the moves model's plan; "" when it touches nothing else."""
    from ledger.engine import moves

    undone = [_quiet(_step(a)) for a in move.touching(moves.UNDO)]
    called_off = [_proposed(a) for a in move.touching(moves.CALL_OFF)]
    parts = []
    if undone:
        parts.append(f"{doing} also undoes what was done before it: {'; '.join(undone)}.")
    if called_off:
        parts.append(f"{'It' if undone else doing} also calls off what was still to come: {'; '.join(called_off)}.")
    return " ".join(parts)


def _unwind_cause(started, events, forward) -> str:
    """The cause on the event; for an event written before causes were recorded, the same fact read from the run."""
    if started.data.get("cause"):
        return started.data["cause"]
    if started.actor == "system:idle":
        return "idle"
    if "why" not in started.data:
        return "operator"
    if any(e.kind == "run.cancel_requested" for e in events):
        return "cancelled"
    if any(a.stopped_by for a in forward):
        return "stopped"
    stopped = next((a for a in reversed(forward) if a.status in STOPPED_BY), None)
    return {A.REJECTED: "rejected", A.EXPIRED: "expired"}.get(stopped.status if stopped else None, "failed")


def _reviews(events, actions, say, company: str) -> list[str]:
    """Statements for each human decision in the audit chain; returns who made them (role and company), in order.

    A declined step is told once, by its own statement (`_not_done`); its reviewer is still listed.
    """
    by_id = {a.pk: a for a in actions}
    people: list[str] = []
    for event in events:
        stopper = (event.data or {}).get("stopped_by") if event.kind == "forward.skipped" else None
        if stopper in ("customer", "operator", "approver"):
            # A person stopped a held step: told once by the step's own statement (`_not_done`), listed here.
            person = "you" if stopper == "customer" else person_at(stopper, company)
            if person not in people:
                people.append(person)
            continue
        if not event.actor.startswith("user:"):
            continue
        action = by_id.get(event.action_ref)
        reason = event.data.get("reason") or ""
        tail = f" {_when(event)}" + (f" ({reason})" if reason else "")
        if event.kind in ("approval.approve", "approval.reject") and action is not None:
            person = person_at("approver", company)
            verb = "approved" if event.kind == "approval.approve" else "declined"
            undone = by_id.get(action.compensates_id) if action.kind == ActionKind.COMPENSATION else None
            if undone is not None:
                say("reviewed", _sentence(f"{person} {verb} undoing this step{tail}: {_quiet(_step(undone))}"))
            elif event.kind == "approval.approve":
                say("reviewed", _sentence(f"{person} approved this step{tail}: {_proposed(action)}"))
        elif event.kind == "run.running" and event.data.get("status_from") == R.NEEDS_ATTENTION:
            person = person_at("operator", company)
            say("reviewed", _sentence(f"{person} reviewed it and had the work resumed{tail}"))
        elif event.kind == "run.unwinding" and "why" not in event.data:  # a cancel says so once, above
            person = person_at("operator", company)
            say("reviewed", _sentence(f"{person} reviewed it and had it undone{tail}"))
        elif event.kind == "run.closed":
            person = person_at("operator", company)
            say("reviewed", _sentence(f"{person} reviewed it and closed it as handled{tail}"))
        elif event.kind == "run.cancel_requested":
            person = person_at("operator", company)
            say("reviewed", _sentence(f"{person} cancelled it{tail}"))
        else:
            continue
        if person not in people:
            people.append(person)
    return people


def _headline(run, forward, not_undone: int, company: str) -> str:
    changed = any(a.status in HAD_EFFECT for a in forward)
    if run.status == R.COMPLETED:
        if any(a.stopped_by for a in forward):
            return "The task ended without the steps that were stopped while they waited; they are listed below."
        if any(a.status in NOT_DONE for a in forward):
            return "The agent finished the task; the steps it did not take are listed below."
        return "The agent finished the task; nothing needed to be corrected."
    if run.status == R.COMPENSATED:
        if not changed:
            return "The agent's task was stopped before it changed anything."
        if not_undone:
            return (f"The agent's changes were undone, except {not_undone} that could not be taken back "
                    f"and {'was' if not_undone == 1 else 'were'} corrected instead.")
        return "Everything the agent changed has been undone."
    if run.status == R.CLOSED:
        return (f"A person at {company} reviewed this and closed it; the statements below say what stands."
                if company else "A person reviewed this and closed it; the statements below say what stands.")
    if run.status == R.NEEDS_ATTENTION:
        if not_undone:
            return "Some of the agent's changes could not be undone automatically; a person is deciding what to do."
        if any(a.status == A.LOST for a in forward):
            return "We do not know yet whether one of the agent's steps was taken; a person is checking."
        return "The agent's task could not be finished automatically; a person is deciding what to do."
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
