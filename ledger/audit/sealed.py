"""The engine's check, just before it acts on a step's row, that the row is what the audit chain recorded.

Anyone with the database's credentials can edit a step's row, and the next event the engine records for the step
fingerprints the row as it then stands (`forward.approved`, `forward.running`): an edit made in between would be
laundered by it, and the tool sent bytes nobody approved. So the event that makes a step (`chain.SEALED_KINDS`) also
records its seal (`chain.seal`: a digest of the body its tool receives and of where the call goes), and a held step's
`forward.held` event records when its window ends (`executes_at`). Both are inside the event's HMAC, whose key is not
in the database.

- `checked_args`, just before a call leaves (ledger/engine/execution.py): the seal recomputed from the row must be the
  recorded one, the row's `args` (what approvers and pages read), `args_hash` (what an approval is bound to) and the
  body must agree with each other, and a step sealed as needing approval must have an authentic `<kind>.approved`
  event (a status moved past the approval in the database is no approval). It answers the arguments to send, parsed
  from the very text it checked.
- `check_hold`, when a held step's window ends (ledger/engine/holds.py): `next_attempt_at` must be the recorded time.
- `check_undo`, just before an undo's call leaves (execution.send calls it before `checked_args`): the step it undoes
  must still be what its success recorded of everything its undo is built from (`chain.undo_seal`: its result,
  compensation plan, arguments, snapshots, target), and the undo must be the one those make (its tool, arguments,
  target and key). The unwinder's own events fingerprint the step as it then stands (`forward.compensating`), and the
  undo is sealed as it was built (`compensation.proposed`): without this an edit of the step's result between its
  success and its unwind would be laundered twice, and the undo tool sent bytes nobody recorded.

A difference raises `Tampered`: the step is not sent (or not released), and its run goes before a person
(`tampered`). `verify_chain` makes the same comparisons for every row (checks `sends`, `hold` and `undo`) and names
every refusal the engine recorded (`TAMPERING`), so neither is laundered by a later event.

A step made before seals were recorded (its making event has no `sends`) is checked for the agreement alone.
"""
from __future__ import annotations

import hmac
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Callable

from django.utils.dateparse import parse_datetime

from ledger.audit.chain import (
    SEALED_KINDS, UNDO_SEALED_KINDS, event_is_authentic, seal, sealed_fields, sent_text, undo_seal,
)
from ledger.canonical import canonical, digest, digest_plain
from ledger.db import mapping, received, sql
from ledger.db.partitions import recent
from ledger.models import Action, AuditEvent

# The event the engine records when it refuses a step whose row differs from what the chain recorded; its data
# names the `check` ("sends" or "hold") and the `problem`. `verify_chain` reports every one of them.
TAMPERING = "tampering.refused"
# The error class of a step refused so, and the recovery item's reason for its run.
TAMPERED = "tampered"


class Tampered(Exception):
    """A step's row is not what the audit chain recorded of it: edited behind the services' back."""

    def __init__(self, check: str, problem: str):
        super().__init__(problem)
        self.check, self.problem = check, problem


def checked_args(action: Action):
    """The arguments to send for `action`, once its row is checked against its seal (raises Tampered otherwise).

    An object whose seal was recorded or checked in this process and whose values are still those it was computed
    from (`chain.sealed_fields`: the API's inline step, the unwinder's fresh undo, an inline retry) is that call
    already; anything read from the database is checked against the event that made it. An undo is checked against
    the step it undoes as well, always (`check_undo`, which the engine calls first: what it was built from is not in
    its own seal)."""
    remembered = getattr(action, "_sealed", None)
    if remembered is not None and remembered[1] == sealed_fields(action):
        return received.loads(action.args_text) if action.args_text else action.args
    text = sent_text(action)
    recorded, approved = recorded_seal(action)
    problem = seal_problem(action, recorded, text) or approval_problem(action, recorded, approved)
    if problem:
        raise Tampered("sends", problem)
    action._sealed = (recorded or seal(action, text), sealed_fields(action))
    return received.loads(text)


def seal_problem(action: Action, recorded: dict | None, text: str | None = None, *, event: int | None = None,
                 target: bool = True, read_plain: bool = False) -> str:
    """Why `action`'s row is not the call its seal `recorded` (None: made before seals were kept), or "" when it is.
    Shared by the engine's check and `verify_chain` (which leaves out the `target` of a step that succeeded: its
    result may have named it then, and passes `read_plain` for a row it read plain: ledger/audit/chain.py)."""
    text = sent_text(action) if text is None else text
    where = f" (event #{event})" if event is not None else ""
    what = f"{action.kind} step {action.seq} (action {action.pk})"
    if recorded is not None:
        now = seal(action, text, read_plain=read_plain)
        if not hmac.compare_digest(str(recorded.get("body", "")), now["body"]):
            return (f"{what} would send arguments other than those recorded when it was proposed{where}: its args_text "
                    "was edited behind the services' back")
        if not hmac.compare_digest(str(recorded.get("call", "")), now["call"]):
            return (f"{what} would call another tool, or with another idempotency key, than recorded when it was "
                    f"proposed{where}: edited behind the services' back")
        if target and not hmac.compare_digest(str(recorded.get("target", "")), now["target"]):
            return (f"{what} would act on another target ({action.target_id!r}) than recorded when it was "
                    f"proposed{where}: edited behind the services' back")
    try:
        agrees = digest(canonical(received.loads(text))) == action.args_hash == \
            (digest_plain if read_plain else digest)(action.args)
    except (TypeError, ValueError):
        agrees = False
    if not agrees:
        return (f"{what}'s arguments, their hash (which approvals are bound to) and the text its tool would receive "
                "disagree: edited behind the services' back")
    return ""


def approval_problem(action: Action, recorded: dict | None, approved: bool) -> str:
    """Why `action` may not be sent for want of the approval its seal says it needs, or "" (`approved`: the chain
    holds an authentic `<kind>.approved` event for it, recorded once its quorum decided)."""
    needed = (recorded or {}).get("approvals") or 0
    if not needed or approved:
        return ""
    return (f"{action.kind} step {action.seq} (action {action.pk}) was proposed needing {needed} person's approval "
            f"and none is recorded in the audit chain: its status was moved behind the services' back")


def by_seq(events, *, newest_first: bool = False) -> list[AuditEvent]:
    """A step's events (a query by its `action_ref`, or rows read) in chain order, sorted here: a step has a few. Read
    without ORDER BY, so that the only index worth using is the step's own (action_ref, tenant), which does not hold
    `seq` (ledger/models.py AuditEvent.Meta); ordered by seq, the planner may walk the chain's (tenant, seq) index of a
    month it has no figures for yet instead, reading every event of the tenant in it."""
    if hasattr(events, "order_by"):
        events = events.order_by()  # not even the model's default ordering
    return sorted(events, key=lambda event: event.seq, reverse=newest_first)


APPROVED_KINDS = tuple(f"{kind.partition('.')[0]}.approved" for kind in SEALED_KINDS)


def recorded_seal(action: Action) -> tuple[dict | None, bool]:
    """The seal the event that made `action` recorded (None for a step made before seals were kept), and whether an
    authentic event recorded it approved; Tampered when there is no making event or it does not verify under the audit
    key it names. One read of the step's few events of those kinds."""
    events = by_seq(AuditEvent.objects.filter(tenant_id=action.tenant_id, action_ref=action.pk,
                                              created_at__gte=recent(action.created_at),
                                              kind__in=(*SEALED_KINDS, *APPROVED_KINDS)))
    made = next((event for event in events if event.kind in SEALED_KINDS), None)
    what = f"{action.kind} step {action.seq} (action {action.pk})"
    if made is None:
        raise Tampered("sends", f"{what} has no record of its proposal in the audit chain: it was written or its "
                                "event removed behind the services' back")
    if not event_is_authentic(made):
        raise Tampered("sends", f"the event that recorded {what} (#{made.seq}) does not verify under its audit key: "
                                "edited behind the services' back")
    approved = any(event.kind in APPROVED_KINDS and event_is_authentic(event) for event in events)
    return (made.data.get("sends") if isinstance(made.data, dict) else None), approved


def check_hold(action: Action) -> None:
    """A held step's window ends when the chain recorded it would (raises Tampered otherwise)."""
    event = next(iter(by_seq(AuditEvent.objects.filter(tenant_id=action.tenant_id, action_ref=action.pk,
                                                       kind="forward.held", created_at__gte=recent(action.created_at),
                                                       data__has_key="executes_at"), newest_first=True)), None)
    what = f"held step {action.seq} (action {action.pk})"
    if event is None:
        raise Tampered("hold", f"{what} has no record of its hold in the audit chain: made held behind the "
                               "services' back")
    if not event_is_authentic(event):
        raise Tampered("hold", f"the event that recorded the hold of {what} (#{event.seq}) does not verify under its "
                               "audit key: edited behind the services' back")
    problem = hold_problem(action, event.data["executes_at"], event=event.seq)
    if problem:
        raise Tampered("hold", problem)


def hold_problem(action: Action, executes_at: str, *, event: int) -> str:
    """Why `action`'s window does not end when the event `event` recorded (`executes_at`), or "" when it does."""
    recorded = parse_datetime(executes_at) if isinstance(executes_at, str) else None
    found = action.next_attempt_at
    if isinstance(found, str):  # SQLite's raw column
        found = parse_datetime(found)
    if recorded is not None and isinstance(found, datetime) and found == recorded:
        return ""
    shown = found.isoformat() if isinstance(found, datetime) else "none"
    return (f"held step {action.seq} (action {action.pk}) runs at {shown}, but its undo window was recorded to end at "
            f"{executes_at} (event #{event}): its time was edited behind the services' back")


def check_undo(undo: Action, *, undo_args: Callable[[Action], object]) -> None:
    """The step `undo` undoes is what its success recorded of everything its undo is built from, and `undo` is the
    undo that makes (raises Tampered otherwise); `undo_args` resolves a step's undo arguments (the engine's
    `unwinding.undo_args`). The step as the unwinder built the undo from it when it is in memory (the unwinder's fresh
    undo), else as the ledger has it now. Inside `one_seal_read_per_unwind` the step's events come from the unwind's
    one read; a problem found so is checked again on a read of the step's own before it is reported."""
    forward = undo.compensates if Action.compensates.is_cached(undo) else Action.objects.get(pk=undo.compensates_id)
    if "run_fingerprint_key" in undo.__dict__:  # one run, one key: read with the undo (ledger/engine/execution.py)
        forward.run_fingerprint_key = undo.run_fingerprint_key
    events = _seals_of_the_unwind(undo, forward)
    if events is not None:
        try:
            if not _undo_problem(undo, forward, undo_args, events):
                return
        except Tampered:
            pass  # a success or plan recorded since that read: the step's own read decides
    problem = _undo_problem(undo, forward, undo_args, None)
    if problem:
        raise Tampered("undo", problem)


def _undo_problem(undo: Action, forward: Action, undo_args, events: list[AuditEvent] | None) -> str:
    recorded, seq = recorded_undo_seal(forward, events=events)
    return (undo_seal_problem(forward, recorded, event=seq) if recorded is not None else "") \
        or built_problem(undo, forward, undo_args)


# An unwind undoes its run's steps one after another: the events that sealed them (`UNDO_SEALED_KINDS`) are read once,
# at its first undo, by the run (one statement instead of one an undo), and kept for this unwind call alone (a context
# variable `one_seal_read_per_unwind` sets: nothing outlives the call or crosses to another request). No seal of the
# run can be recorded meanwhile but a late success (an undo's plan is completed only while the run needs attention,
# which ends the call): a step the read lacks, or whose row fails the check, is read again on its own before
# anything is refused.
_UNWIND_SEALS: ContextVar[dict | None] = ContextVar("unwind_undo_seals", default=None)


def _seals_read(of: str) -> str:
    """A read of sealing events (`UNDO_SEALED_KINDS`), as text (Django's query building cost more than the read,
    about 0.5 ms a compensation on the failing saga's profile): parameters the tenant, the step or run `of` names,
    the partition key's lower bound, the kinds. No ORDER BY: `by_seq`."""
    return (f"SELECT {sql.columns(AuditEvent, 'e')[0]} FROM {AuditEvent._meta.db_table} e WHERE e.tenant_id = %s"
            f" AND {of} AND e.created_at >= %s AND e.kind IN ({', '.join(['%s'] * len(UNDO_SEALED_KINDS))})")


# An unwind's one read of its run's seals; and a step's own, for an undo outside an unwind (or one the first lacks).
RUN_SEALS_READ = _seals_read("e.run_ref = %s AND e.action_ref IS NOT NULL")
UNDO_SEAL_READ = _seals_read("e.action_ref = %s")


@contextmanager
def one_seal_read_per_unwind(run_id: int):
    token = _UNWIND_SEALS.set({"run": run_id, "by_step": None})
    try:
        yield
    finally:
        _UNWIND_SEALS.reset(token)


def _seals_of_the_unwind(undo: Action, forward: Action) -> list[AuditEvent] | None:
    """`forward`'s sealing events from its unwind's one read (made now if it is the first undo), or None outside an
    unwind of its run, or without the run in hand (its creation bounds the read's months)."""
    read = _UNWIND_SEALS.get()
    if read is None or read["run"] != forward.run_id or not Action.run.is_cached(undo) or undo.run is None:
        return None
    if read["by_step"] is None:
        read["by_step"] = {}
        for row in sql.fetch_all(RUN_SEALS_READ, [forward.tenant_id, forward.run_id, sql.value(
                AuditEvent, "created_at", recent(undo.run.created_at)), *UNDO_SEALED_KINDS]):
            event = sql.instance(AuditEvent, row)
            read["by_step"].setdefault(event.action_ref, []).append(event)
    return read["by_step"].get(forward.pk, [])


def recorded_undo_seal(forward: Action, *, events: list[AuditEvent] | None = None) -> tuple[str | None, int | None]:
    """The undo seal the latest of `forward`'s success and undo completions recorded, and that event's number; (None,
    None) for a step that succeeded before undo seals were kept. Tampered when no success of it is recorded, or the
    event does not verify under its audit key. `events`: the step's sealing events already read, else read here."""
    if events is None:
        events = [sql.instance(AuditEvent, row) for row in sql.fetch_all(UNDO_SEAL_READ, [
            forward.tenant_id, forward.pk, sql.value(AuditEvent, "created_at", recent(forward.created_at)),
            *UNDO_SEALED_KINDS])]
    events = by_seq(events, newest_first=True)
    what = f"step {forward.seq} (action {forward.pk})"
    if not events:
        raise Tampered("undo", f"{what} has no record of its success in the audit chain, yet it is being undone: its "
                               "status was moved behind the services' back")
    event = next((event for event in events if isinstance(event.data, dict) and "undo" in event.data), None)
    if event is None:
        return None, None
    if not event_is_authentic(event):
        raise Tampered("undo", f"the event that recorded the success of {what} (#{event.seq}) does not verify under "
                               "its audit key: edited behind the services' back")
    return str(event.data["undo"]), event.seq


def undo_seal_problem(forward: Action, recorded: str, *, event: int, read_plain: bool = False) -> str:
    """Why `forward` is not what the event `event` recorded its undo would be built from (`recorded`), or ""."""
    if hmac.compare_digest(recorded, undo_seal(forward, read_plain=read_plain)):
        return ""
    return (f"the undo of step {forward.seq} (action {forward.pk}) would be built from a result, compensation plan, "
            f"arguments or snapshot other than those recorded when the step succeeded (event #{event}): edited behind "
            "the services' back")


def built_problem(undo: Action, forward: Action, undo_args: Callable[[Action], object]) -> str:
    """Why `undo` is not the undo `forward` makes (its tool, arguments, target, key), or "": an undo built from a
    step edited and put back since is not the step's undo."""
    what = f"undo step {undo.seq} (action {undo.pk}) of step {forward.seq}"
    plan = forward.compensation_plan or {}
    try:
        args_agree = digest(canonical(undo_args(forward))) == undo.args_hash
    except (mapping.MappingError, TypeError, ValueError):
        args_agree = False
    key = f"{forward.idempotency_key}:undo"
    if not args_agree or (isinstance(plan.get("tool_id"), int) and plan["tool_id"] != undo.tool_id) \
            or undo.target_id != forward.target_id or undo.key_agent != forward.key_agent \
            or not (undo.idempotency_key == key or undo.idempotency_key.startswith(key + ":")):
        return (f"{what} is not the undo its step makes (its tool, arguments, target or key differ from what the "
                "step's compensation plan resolves to): edited behind the services' back")
    return ""
