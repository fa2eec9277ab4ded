"""A held step's notice to the person its run acts for: the trail's link and the deadline to stop it.

The engine holds a step whose policy says `hold: {customer_can_stop: true}`, and recovery/stops.py's
`on_action_held` asks this module, inside the engine's transaction, whether and where to send the notice. The run's
`on_behalf_of` is the agent's word, so it is not enough: a notice goes out only when

- the tenant's list of known customer addresses covers that address (recovery/customers.py), and goes to the list's
  spelling of it; an address the agent made up gets nothing, and an operator may still send the trail's link from
  the run's page (a person's decision, `trail_send`);
- the agent's runs sent fewer than UNWIND_HOLD_NOTICES_PER_AGENT notices within the last UNWIND_HOLD_NOTICE_WINDOW
  seconds. The count is of `HoldNotice` rows, read under the tenant's chain lock that the engine's transaction
  holds, so every web process on every machine counts the same notices and two cannot both take the last one.

Its text is in the tenant's words only: the tool's own description (policy, written by the tenant's admins) and
the amounts its display hints format as money. No argument, goal or other text of the agent's is in it.

Every decision is a `HoldNotice` row and an audit event of the step, `hold.customer_notified` (to whom) or
`hold.customer_not_notified` (why), which the agent reads in its run's events (`GET /api/v1/runs/{id}/events`), an
MCP client in the held step's answer (`customer_notice`), and operators on the run's timeline.
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from approvals.services import notify
from ledger.audit.chain import ledger_transaction
from ledger.models import Action, Run
from ledger.policy.display import money_in
from recovery.customers import known_recipient
from recovery.models import HoldNotice
from recovery.trail import _first_sentence, _lower_first, _sentence, new_share_link, trail_share_url

ACTOR = "system:hold"
NOTIFIED, NOT_NOTIFIED = "hold.customer_notified", "hold.customer_not_notified"


def notice_words(action: Action) -> str:
    """What the step will do, for the customer: "We are about to charge a customer's card (€42.00)." From the
    tool's description and its amounts as money; never the agent's own text."""
    what = _lower_first(_first_sentence(action.tool.description)) or "take a step on your behalf"
    amounts = money_in(action.args, action.tool.display)
    return _sentence(f"we are about to {what}" + (f" ({', '.join(amounts)})" if amounts else ""))


def also_words(action: Action, run: Run) -> str:
    """What else stopping the step does (the moves model's plan), in the tools' own descriptions, never the agent's
    text: "Stopping it also undoes 2 earlier steps: book a flight; reserve a hotel room." "" when nothing else."""
    from ledger.engine import moves

    actions = list(run.actions.select_related("tool").order_by("seq"))
    move = moves.stop_move(run, actions, next(a for a in actions if a.pk == action.pk), moves.CUSTOMER)
    undone = [_lower_first(_first_sentence(a.tool.description)) or "an earlier step" for a in move.undoes]
    if not undone:
        return ""
    steps = "an earlier step" if len(undone) == 1 else f"{len(undone)} earlier steps"
    return f"Stopping it also undoes {steps} of this request: {'; '.join(undone)}."


def notices_sent_recently(*, tenant_id: int, agent_id: int | None) -> int:
    """Notices the agent's runs sent within the window (runs without an agent count together)."""
    since = timezone.now() - timedelta(seconds=settings.UNWIND_HOLD_NOTICE_WINDOW)
    return HoldNotice.objects.filter(tenant_id=tenant_id, agent_id=agent_id, sent=True, created_at__gte=since).count()


def hold_notice_send(*, action: Action, run: Run) -> HoldNotice:
    """Decide the notice for a held step the customer may stop, and send it (an outbox row) or record why not.

    Runs in the engine's transaction (re-entered here, so under the tenant's chain lock either way)."""
    with ledger_transaction(run.tenant_id) as audit:
        recipient, why = known_recipient(tenant_id=run.tenant_id, address=run.on_behalf_of or "")
        if recipient is not None:
            sent, bound = notices_sent_recently(tenant_id=run.tenant_id, agent_id=run.agent_id), \
                settings.UNWIND_HOLD_NOTICES_PER_AGENT
            if sent >= bound:
                recipient, why = None, (f"this agent's runs already sent {sent} hold notices in the last "
                                        f"{settings.UNWIND_HOLD_NOTICE_WINDOW} s, the most "
                                        "UNWIND_HOLD_NOTICES_PER_AGENT allows")
        if recipient is None:
            notice = HoldNotice.objects.create(tenant_id=run.tenant_id, run=run, action=action, agent_id=run.agent_id,
                                               sent=False, why=f"The customer was not notified: {why}.")
            audit.record(NOT_NOTIFIED, actor=ACTOR, action=action, why=notice.why)
            return notice
        token = new_share_link(run=run, actor=ACTOR, sent_to=recipient)
        company = run.tenant.name
        notify(tenant_id=run.tenant_id, kind="hold_notice", recipients=[recipient],
               subject=f"{company} is about to act on your request (reference {run.pk})",
               template="recovery/email/hold_notice",
               context={"run": run, "company": company, "url": trail_share_url(token),
                        "executes_at": action.next_attempt_at, "words": notice_words(action),
                        "also": also_words(action, run)})
        notice = HoldNotice.objects.create(
            tenant_id=run.tenant_id, run=run, action=action, agent_id=run.agent_id, sent=True, sent_to=recipient,
            why=f"The customer was notified at {recipient}, a known customer address, with the trail's link.")
        audit.record(NOTIFIED, actor=ACTOR, action=action, to=recipient, why=notice.why)
    return notice


def notice_of(action_id: int) -> dict | None:
    """What became of a held step's notice, as an agent is told it: {notified, why}; None when there was none to
    send (the customer may not stop the step)."""
    notice = HoldNotice.objects.filter(action_id=action_id).order_by("-pk").first()
    if notice is None:
        return None
    return {"notified": notice.sent, "why": notice.why}
