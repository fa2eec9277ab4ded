"""The recovery queue: items opened by the engine, resolved by people through the engine's run services."""
from __future__ import annotations

from django.db.models import Q
from django.utils import timezone

from approvals.services import notify, require_role
from ledger.audit.chain import recording
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import RISK_ORDER, Action, ActionKind, ActionStatus, Membership, Risk, Role, Run
from ledger.engine.runs import resume_refusal, run_close, run_compensate, run_resume
from ledger.engine.undo_plans import undo_plan_complete
from recovery.models import ItemStatus, RecoveryItem

SUGGESTIONS = {
    "step_failed": "Resume to retry the failed step with its same idempotency key, or close it if it was handled elsewhere.",
    "compensation_failed": "Compensate to try the failed compensations again (newest first), or close it after undoing by hand.",
    "verification_failed": "Check the target: compensate to undo the step, resume to accept it and go on, or close it.",
    "drift": "Someone changed the target after the agent did. Compensate to overwrite it with the before-state anyway, or close it to keep their change.",
    "approval_rejected": "The pivot has committed: resume to go on, compensate to undo what can be undone, or close it.",
    "approval_expired": "The pivot has committed: resume to go on, compensate to undo what can be undone, or close it.",
    "lease_lost": "The outcome of the step is unknown: check the target. If the tool did not act, send it again (your "
                  "decision is recorded); if it did, compensate to undo it, or close it.",
    "outcome_unknown": "The tool kept answering errors that leave its effect unknown: check the target. If the tool did "
                       "not act, send it again (your decision is recorded); if it did, compensate to undo it, or close it.",
    "settle_failed": "Unwind failed while recording the step's outcome (the item says where). Check the target: if the "
                     "step acted, compensate to undo it or resume to go on; if it did not, send it again; or close it.",
    "read_back_incomplete": "The step did act (reading it back found it), but its record lacks what its result or undo "
                            "needs. Complete its undo from the record shown, then undo it or keep the undo and resume; "
                            "or resume to accept it as it is, or close it.",
    "cancelled_after_pivot": "The run was cancelled after its pivot: compensate to undo what can be undone, or close it.",
    "irreversible_effects": "Some effects cannot be undone automatically: handle them by hand, then close it.",
    "customer_request": "The person the run acted for asks for a correction (their words are below): compensate to "
                        "undo what can be undone, resume to let the run go on, or close it; and write them a reply.",
    "tampered": "Someone changed this step in the database after it was recorded (its arguments, where it goes or when "
                "its undo window ends differ from what the audit chain holds), so Unwind did not send it. Find out who: "
                "`manage.py verify_audit` names the check. Then compensate to undo the run's earlier steps, or close it; "
                "resuming refuses the step again while its row differs.",
    "idle_after_pivot": "The agent went away after the pivot committed: resume to let it go on (its next step is "
                        "its own), compensate to undo what can be undone, or close it.",
}


# The audit events that carry a recovery item's fingerprint (see recovery/apps.py).
RECOVERY_EVENTS = ("recovery.opened", "recovery.updated", "recovery.resolved", "recovery.noted")


def item_risk(run: Run) -> str:
    risks = list(run.actions.filter(kind=ActionKind.FORWARD).exclude(
        status__in=[ActionStatus.SKIPPED, ActionStatus.REJECTED, ActionStatus.EXPIRED, ActionStatus.COMPENSATED])
        .values_list("risk", flat=True))
    return max(risks, key=lambda r: RISK_ORDER[r], default=Risk.LOW)


def on_run_needs_attention(*, run: Run, reason: str, detail: str, action: Action | None) -> None:
    with recording(run.tenant_id) as audit:
        item = RecoveryItem.objects.filter(run=run, status=ItemStatus.OPEN).first()
        if item is not None:
            RecoveryItem.objects.filter(pk=item.pk).update(reason=reason, detail=detail, action=action)
            item.reason, item.detail, item.action = reason, detail, action
            audit.record("recovery.updated", actor="system:engine", item=item.pk, reason=reason, rows=[item])
            return
        item = RecoveryItem.objects.create(
            tenant_id=run.tenant_id, run=run, action=action, reason=reason, risk=item_risk(run),
            tool_name=action.tool.name if action is not None else "", detail=detail,
            suggestion=SUGGESTIONS.get(reason, "Resume, compensate or close it."))
        audit.record("recovery.opened", actor="system:engine", item=item.pk, reason=reason, rows=[item])
    operators = sorted(set(Membership.objects.filter(tenant_id=run.tenant_id, role__in=[Role.OPERATOR, Role.ADMIN])
                           .exclude(user__email="").values_list("user__email", flat=True)))
    notify(tenant_id=run.tenant_id, kind="run_needs_attention", recipients=operators,
           subject=f"[Unwind] Run {run.pk} needs attention: {item.get_reason_display()}",
           template="recovery/email/run_needs_attention", context={"item": item, "run": run, "url": f"/console/recovery/{item.pk}/"})


def on_run_attention_cleared(*, run: Run, resolution: str, actor: str) -> None:
    now = timezone.now()
    with recording(run.tenant_id) as audit:
        for item in RecoveryItem.objects.filter(run=run, status=ItemStatus.OPEN):
            if RecoveryItem.objects.filter(pk=item.pk, status=ItemStatus.OPEN).update(
                    status=ItemStatus.RESOLVED, resolution=resolution, resolved_by=actor, resolved_at=now) != 1:
                continue
            item.status, item.resolution = ItemStatus.RESOLVED, resolution
            item.resolved_by, item.resolved_at = actor, now
            audit.record("recovery.resolved", actor=actor, item=item.pk, resolution=resolution, rows=[item])


def _open_item(item: RecoveryItem, user, *, role: str = Role.OPERATOR) -> RecoveryItem:
    require_role(user, item.tenant_id, role)
    item.refresh_from_db()
    if item.status != ItemStatus.OPEN:
        raise StateConflict(f"this item was already {item.resolution or item.status} by {item.resolved_by or 'someone'}")
    return item


def recovery_resume(*, item: RecoveryItem, user, reason: str = "") -> RecoveryItem:
    item = _open_item(item, user)
    run_resume(run=item.run, actor=f"user:{user.get_username()}", reason=reason)
    return _after(item, reason)


def recovery_compensate(*, item: RecoveryItem, user, reason: str = "", unknown: str = "") -> RecoveryItem:
    """Compensate the item's run; `unknown` settles its steps of unknown outcome in the same decision
    (ledger/engine/unknowns.py)."""
    item = _open_item(item, user)
    run_compensate(run=item.run, actor=f"user:{user.get_username()}", reason=reason, force=item.reason == "drift",
                   unknown=unknown)
    return _after(item, reason)


def recovery_close(*, item: RecoveryItem, user, reason: str) -> RecoveryItem:
    item = _open_item(item, user)
    run_close(run=item.run, actor=f"user:{user.get_username()}", reason=reason)
    return _after(item, reason)


def _after(item: RecoveryItem, reason: str) -> RecoveryItem:
    if reason:
        with recording(item.tenant_id) as audit:
            if RecoveryItem.objects.filter(pk=item.pk).filter(~Q(resolution_note=reason[:4000])).update(
                    resolution_note=reason[:4000]) == 1:
                item.refresh_from_db()
                audit.record("recovery.noted", actor=item.resolved_by or "system:engine", item=item.pk, rows=[item])
    item.refresh_from_db()
    return item


# What a person may do with the undo they complete on a `read_back_incomplete` item.
UNDO_PLAN_THEN = {
    "compensate": "Undo the step now with these arguments (compensate the run)",
    "resume": "Keep them as the step's undo and resume the run",
}


def recovery_complete_undo(*, item: RecoveryItem, user, args, then: str, reason: str = "") -> RecoveryItem:
    """A `read_back_incomplete` item: record the undo arguments `user` completed for its step (their decision, in
    the audit chain), then compensate the run with them or resume it (`then`)."""
    item = _open_item(item, user)
    if item.reason != "read_back_incomplete" or item.action is None:
        raise StateConflict("only a step found done whose record lacks what its undo needs has an undo to complete")
    if then not in UNDO_PLAN_THEN:
        raise ValidationFailed(f"then must be one of {', '.join(UNDO_PLAN_THEN)}", field="then")
    if then == "resume" and (refusal := resume_refusal(item.run)):
        raise StateConflict(refusal)
    actor = f"user:{user.get_username()}"
    undo_plan_complete(step=item.action, args=args, actor=actor, reason=reason)
    if then == "compensate":
        run_compensate(run=item.run, actor=actor, reason=reason)
    else:
        run_resume(run=item.run, actor=actor, reason=reason)
    return _after(item, reason)
