"""Erasing a person's data at their request without breaking the audit chain (issue 42).

Who the person is: the address a run acts for (`Run.on_behalf_of`, matched without regard to case). What is theirs:
everything text in those runs — the run's goal, intent, attention detail and the address itself; every text value of
its steps' arguments, results, snapshots and intents, their targets, error messages, decision reasons and the text
the agent sent; and wherever any of those texts was copied (approval previews and reasons, recovery items, checkpoints,
customer requests and replies, hold notices, emails in the outbox, the runs' audit events). Each is replaced by the
marker "erased on <date> at the person's request". Numbers and yes/no values stay (amounts, counts: the running
totals of limits are kept from them, and no text of the person's is in them); so do the tool, statuses and times.
The trail's share links of the runs are revoked and answer 410.

The chain keeps verifying (ledger/audit/erased.py): the erasure's own event records the erased rows' fingerprints and
a digest of each rewritten event, and each run's key is blanked, so the digests the chain kept of their data (made
under that key, ledger/audit/subjects.py) can no longer be tested against a guess. The events of a run opened before
keys existed hold bare digests of its rows: they are counted (`unkeyed_events`) and said.

Only settled runs are erased: a step's undo is built from its arguments and result, so a run that may still move
(running, waiting for approval, unwinding, needing attention) is refused with the runs named; erase again once each
is completed, compensated or closed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest, Notification
from approvals.services import require_role
from ledger.audit import erased, subjects
from ledger.audit.chain import FINGERPRINT_KEYS, action_fingerprint, ledger_transaction, run_fingerprint
from ledger.canonical import digest, dumps
from ledger.db import sql
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import (
    RUN_FINAL, Action, Attempt, AuditEvent, Checkpoint, ErasedRun, Erasure, Role, Run, Tenant,
)
from recovery.models import CustomerRequest, HoldNotice, RecoveryItem, TrailShareLink

ACTOR = "system:erasure"  # who revoked the runs' share links (recovery/trail_views.py answers 410 for them)
MIN_TEXT = 3  # shorter texts of a run ("ok", "no") are erased where they stand, not looked for elsewhere


def marker(at) -> str:
    return f"erased on {at:%Y-%m-%d} at the person's request"


@dataclass
class ErasureResult:
    tenant: str
    runs: int = 0
    actions: int = 0
    fields: int = 0
    events: int = 0
    unkeyed_events: int = 0
    erased_at: object = None
    notes: list[str] = field(default_factory=list)

    def sentence(self) -> str:
        if not self.runs:
            return " ".join([f"tenant {self.tenant}: no run in the hot tables acts for this person (never recorded, "
                             "or already erased): nothing changed.", *self.notes])
        said = (f"tenant {self.tenant}: erased {self.runs} run(s), {self.actions} step(s), {self.fields} stored "
                f"value(s) and {self.events} audit event(s) on {self.erased_at:%Y-%m-%d}; the chain still verifies")
        return " ".join([said + ".", *self.notes])


def _walk(value, replace, key_replace=None):
    """A copy of a JSON value with each string leaf (and each key, with `key_replace`) passed through."""
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, list):
        return [_walk(item, replace, key_replace) for item in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            name = key_replace(key) if key_replace else key
            while name in out:
                name += " "
            out[name] = _walk(item, replace, key_replace)
        return out
    return value


def _strings(value, into: set) -> None:
    _walk(value, lambda text: into.add(text) or text, lambda key: key)


class _Scrubber:
    """Replaces the person's texts, counting each value it replaces."""

    def __init__(self, texts: set[str], mark: str):
        self.texts = sorted((text for text in texts if len(text) >= MIN_TEXT and text != mark), key=len, reverse=True)
        self.lowered = [text.casefold() for text in self.texts]
        self.mark = mark
        self.count = 0

    def holds(self, text: str) -> bool:
        if not text or text == self.mark:
            return False
        folded = text.casefold()
        # A text that holds one of theirs, or (at 12 characters or more) is a cut of one ("goal"[:500] in events).
        return any(theirs in folded for theirs in self.lowered) or (
            len(text) >= 12 and any(folded in theirs for theirs in self.lowered))

    def text(self, value: str, *, whole: bool = False) -> str:
        """`whole`: the value is theirs whatever it says (a step's argument, a run's goal)."""
        if value and value != self.mark and (whole or self.holds(value)):
            self.count += 1
            return self.mark
        return value

    def json(self, value, *, whole: bool = False):
        return _walk(value, lambda text: self.text(text, whole=whole),
                     lambda key: self.mark if self.holds(key) else key)


def _update(model, pk, changes: dict) -> None:
    if changes:
        model._default_manager.filter(pk=pk).update(**changes)


def _changed(row, values: dict) -> dict:
    return {name: value for name, value in values.items() if getattr(row, name) != value}


def subject_erase(*, tenant: Tenant, subject: str, reason: str, by: str) -> ErasureResult:
    """Erase the data of the person `subject` (an address a run acts for) from `tenant`'s ledger, audited as `by`
    for `reason` (which may not name them). Erasing a person with no run left is a no-op that says so."""
    subject, reason, by = (subject or "").strip(), (reason or "").strip(), (by or "").strip()
    if not subject:
        raise ValidationFailed("subject: say whose data to erase (the address their runs act for)", field="subject")
    if not reason:
        raise ValidationFailed("reason: say why (the request's reference, not the person's name or address)",
                               field="reason")
    if not by:
        raise ValidationFailed("by: say who erases", field="by")
    if subject.casefold() in reason.casefold() or subject.casefold() in by.casefold():
        raise ValidationFailed("reason: it names the person being erased; the audit chain keeps the reason, so give "
                               "a reference instead", field="reason")
    # Read before the chain's lock is taken: the segments may be fetched from a bucket, and segments never change.
    result = ErasureResult(tenant=tenant.slug, notes=_archived_runs_of(tenant, subject))
    with ledger_transaction(tenant.pk) as log:
        runs = list(Run.objects.filter(tenant=tenant, on_behalf_of__iexact=subject).order_by("pk"))
        runs = [run for run in runs if run.on_behalf_of.casefold() == subject.casefold()]
        if not runs:
            return result
        unsettled = [run for run in runs if run.status not in RUN_FINAL]
        if unsettled:
            named = ", ".join(f"run {run.pk} ({run.status})" for run in unsettled[:10])
            more = f" and {len(unsettled) - 10} more" if len(unsettled) > 10 else ""
            raise StateConflict(
                f"not erased: {named}{more} of this person is not settled, and its steps may still be sent or undone "
                "from their arguments and results. Nothing was changed. Erase again once every run of theirs is "
                "completed, compensated or closed.")
        result.erased_at = now = timezone.now()
        mark = marker(now)
        run_ids = [run.pk for run in runs]
        actions = list(Action.objects.filter(run_id__in=run_ids).order_by("pk"))
        action_ids = [action.pk for action in actions]

        texts: set[str] = set()
        for run in runs:
            texts.update([run.on_behalf_of, run.goal, run.attention_detail])
            _strings(run.intent, texts)
        for action in actions:
            texts.update([action.target_id, action.error_message, action.decision_reason])
            for value in (action.args, action.result, action.before, action.after, action.intent):
                _strings(value, texts)
        scrub = _Scrubber(texts, mark)

        unkeyed = AuditEvent.objects.filter(tenant=tenant, run_ref__in=[run.pk for run in runs
                                                                         if not run.fingerprint_key]).count()
        for run in runs:
            # The run's key goes: what the chain recorded under it can no longer be tested against a guess.
            _update(Run, run.pk, _changed(run, {
                "fingerprint_key": "",
                "on_behalf_of": scrub.text(run.on_behalf_of, whole=True), "goal": scrub.text(run.goal, whole=True),
                "attention_detail": scrub.text(run.attention_detail, whole=True),
                "intent": scrub.json(run.intent, whole=True)}))
        for action in actions:
            args = scrub.json(action.args, whole=True)
            _update(Action, action.pk, _changed(action, {
                "args": args, "args_text": dumps(args) if action.args_text else "", "args_hash": digest(args),
                "content_key": "", "idempotency_key": f"erased:{action.pk}",
                "target_id": scrub.text(action.target_id, whole=True),
                "result": scrub.json(action.result, whole=True), "before": scrub.json(action.before, whole=True),
                "after": scrub.json(action.after, whole=True), "intent": scrub.json(action.intent, whole=True),
                "error_message": scrub.text(action.error_message, whole=True),
                "decision_reason": scrub.text(action.decision_reason, whole=True),
                "verification": scrub.json(action.verification), "compensation_plan": scrub.json(action.compensation_plan),
                "policy_decision": scrub.json(action.policy_decision)}))
        for attempt in Attempt.objects.filter(action_id__in=action_ids):
            _update(Attempt, attempt.pk, _changed(attempt, {"error_message": scrub.text(attempt.error_message)}))
        for checkpoint in Checkpoint.objects.filter(run_id__in=run_ids):
            _update(Checkpoint, checkpoint.pk, _changed(checkpoint, {"state": scrub.json(checkpoint.state)}))
        requests = list(ApprovalRequest.objects.filter(run_id__in=run_ids))
        for request in requests:
            _update(ApprovalRequest, request.pk, _changed(request, {
                "preview": scrub.json(request.preview), "outcome_reason": scrub.text(request.outcome_reason)}))
        for decision in ApprovalDecision.objects.filter(request__run_id__in=run_ids):
            _update(ApprovalDecision, decision.pk, _changed(decision, {"reason": scrub.text(decision.reason)}))
        earliest = min(run.created_at for run in runs)
        for note in Notification.objects.filter(Q(request__run_id__in=run_ids) | Q(tenant=tenant,
                                                                                   created_at__gte=earliest)):
            _update(Notification, note.pk, _changed(note, {
                "subject": scrub.text(note.subject), "body_text": scrub.text(note.body_text),
                "body_html": scrub.text(note.body_html), "last_error": scrub.text(note.last_error),
                "recipients": scrub.json(note.recipients)}))
        items = list(RecoveryItem.objects.filter(run_id__in=run_ids))
        for item in items:
            _update(RecoveryItem, item.pk, _changed(item, {
                "detail": scrub.text(item.detail), "suggestion": scrub.text(item.suggestion),
                "resolution_note": scrub.text(item.resolution_note)}))
        for link in TrailShareLink.objects.filter(run_id__in=run_ids):
            _update(TrailShareLink, link.pk, _changed(link, {
                "sent_to": "", "revoked_at": link.revoked_at or now, "revoked_by": ACTOR}))
        for asked in CustomerRequest.objects.filter(run_id__in=run_ids):
            _update(CustomerRequest, asked.pk, _changed(asked, {
                "text": scrub.text(asked.text, whole=True), "reply": scrub.text(asked.reply)}))
        for notice in HoldNotice.objects.filter(run_id__in=run_ids):
            _update(HoldNotice, notice.pk, _changed(notice, {"sent_to": "", "why": scrub.text(notice.why)}))

        subjects.forget()
        rewritten = _rewrite_events(tenant.pk, run_ids, action_ids, subject, scrub)

        result.runs, result.actions, result.fields = len(runs), len(actions), scrub.count
        result.events, result.unkeyed_events = len(rewritten), unkeyed
        erasure = Erasure.objects.create(tenant=tenant, erased_at=now, erased_by=by[:160], reason=reason,
                                         runs=result.runs, actions=result.actions, fields=result.fields,
                                         events=result.events, unkeyed_events=unkeyed)
        marked = [ErasedRun.objects.create(tenant=tenant, run_id=pk, erasure=erasure, erased_at=now) for pk in run_ids]
        erased_rows = {f"run:{run.pk}": run_fingerprint(run) for run in Run.objects.filter(pk__in=run_ids)}
        erased_rows.update({f"action:{action.pk}": action_fingerprint(action)
                            for action in Action.objects.filter(pk__in=action_ids)})
        fresh = [*ApprovalRequest.objects.filter(pk__in=[r.pk for r in requests]),
                 *RecoveryItem.objects.filter(pk__in=[i.pk for i in items])]
        log.record(erased.KIND, actor=by[:160], rows=[erasure, *marked, *fresh], erased_rows=erased_rows,
                   rewritten=rewritten, runs=result.runs, actions=result.actions, fields=result.fields,
                   events=result.events, unkeyed_events=unkeyed, reason=reason[:1000])
    if unkeyed:
        result.notes.append(
            f"{unkeyed} of their runs' audit events were recorded before fingerprints were keyed: those "
            "events keep bare SHA-256 digests of the rows as they then stood, which someone holding the rest of a row "
            "could test a guess against; the events' own text was erased.")
    return result


def _archived_runs_of(tenant: Tenant, subject: str) -> list[str]:
    """What erasure cannot reach in the tenant's archive (docs/archive.md): segments are content-addressed and
    signed into the chain, never rewritten, so a run of the person's archived before keeps its text there. Named,
    so the person's request can be answered truthfully (SECURITY.md)."""
    from ledger.archive import chain as archive_chain
    from ledger.errors import ArchiveUnavailable
    from ledger.models import ArchiveSegment

    if not ArchiveSegment.objects.filter(tenant=tenant).exists():
        return []
    try:
        found = sorted({(number, row["id"]) for number, rows in archive_chain.load(tenant.pk).rows()
                        for row in rows.get("ledger.run", [])
                        if str(row.get("on_behalf_of") or "").casefold() == subject.casefold()})
    except (ArchiveUnavailable, archive_chain.ArchiveBroken) as exc:  # said, rather than claiming there is none
        return [f"The archive could not be read ({exc}), so whether it holds runs of this person "
                "is not known: archived runs are never rewritten by erasure (SECURITY.md)."]
    if not found:
        return []
    segments = sorted({number for number, _ in found})
    return [f"{len(found)} archived run(s) of this person ({', '.join(f'run {pk}' for _, pk in found[:20])}) stay "
            f"in archive segment(s) {', '.join(map(str, segments))}: erasure does not rewrite archives "
            "(SECURITY.md); they leave only when those segments are deleted."]


def subject_erase_by(*, user, tenant: Tenant, subject: str, reason: str) -> ErasureResult:
    """The console's erasure: tenant admins only."""
    require_role(user, tenant.pk, Role.ADMIN)
    return subject_erase(tenant=tenant, subject=subject, reason=reason, by=f"user:{user.get_username()}")


def _rewrite_events(tenant_id: int, run_ids: list[int], action_ids: list[int], subject: str,
                    scrub: _Scrubber) -> dict[str, str]:
    """Erase the person's texts from the events of their runs (and any event of the tenant naming their address),
    leaving the fingerprints; returns {seq: digest of the event as it now stands} for the erasure's event."""
    vouched = {}
    pattern = "%" + subject.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    like = "ILIKE" if connection.vendor == "postgresql" else "LIKE"
    cast = "::text" if connection.vendor == "postgresql" else ""
    naming = sql.fetch_all(f"SELECT id FROM ledger_auditevent WHERE tenant_id = %s AND (actor {like} %s ESCAPE '\\' "
                           f"OR data{cast} {like} %s ESCAPE '\\')", [tenant_id, pattern, pattern])
    events = AuditEvent.objects.filter(Q(tenant_id=tenant_id) & (Q(run_ref__in=run_ids) | Q(action_ref__in=action_ids)
                                                                 | Q(pk__in=[row[0] for row in naming]))).order_by("seq")
    for event in events:
        data = event.data if isinstance(event.data, dict) else {}
        kept = {name: data[name] for name in FINGERPRINT_KEYS if name in data}
        new_data = {**scrub.json({name: value for name, value in data.items() if name not in kept}), **kept}
        new_actor = scrub.text(event.actor)
        if new_data == data and new_actor == event.actor:
            continue
        AuditEvent.objects.filter(pk=event.pk).update(data=new_data, actor=new_actor)
        event.data, event.actor = AuditEvent.objects.values_list("data", flat=True).get(pk=event.pk), new_actor
        vouched[str(event.seq)] = erased.vouch(event)
    return vouched

