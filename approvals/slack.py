"""Approve from Slack: an approval request is posted to a channel with Approve / Reject buttons.

Posting is an outbox (`SlackMessage`, written in the request's transaction, posted by the worker's sweep), so
a rolled-back request posts nothing and a Slack outage loses nothing. A click comes back to
`POST /integrations/slack/interactions/` (approvals/links.py, decided in approvals/clicks.py), signed by Slack; it counts only when:
- the signature and timestamp verify against UNWIND_SLACK_SIGNING_SECRET (else 401, nothing read further);
- the Slack user is mapped to an Unwind person of the request's tenant (`SlackIdentity`, set by an admin with
  `manage.py slack_identity`; the payload's names and emails are never trusted);
- the button's args hash is still the request's and its action's;
- the request is one a message can show in full (approvals/surfaces.py): one too large is posted with what fits,
  what it left out and an "Open to decide" link instead of buttons, and a click for it, however made, is refused.
What the agent wrote is escaped for mrkdwn and labelled as its own (ledger/agent_text.py).
The decision is then that person's, through `approval_decide`: quorum, separation of duties, expiry and
void-on-policy-change hold as on the approval page. The message shows the outcome however the request was
settled (Slack, an email link, the approval page, expiry, a void). A request that no longer waits when its message
is due to be posted (decided, withdrawn, voided or expired meanwhile) is not posted at all: the row says why.
"""
from __future__ import annotations

import json
import logging
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from approvals import surfaces
from approvals.models import ApprovalRequest, ApprovalStatus, Decision, SlackMessage
from approvals.waiting import no_longer_waiting
from ledger import agent_text
from ledger.executors import egress
from ledger.errors import UnwindError, ValidationFailed

log = logging.getLogger("unwind.approvals.slack")
MAX_POST_ATTEMPTS = 8
ACTION_IDS = {"unwind_approve": Decision.APPROVE, "unwind_reject": Decision.REJECT}
OPEN_ACTION = "unwind_open"  # a link button: Slack reports its click too, and it decides nothing


class SlackSignatureInvalid(UnwindError):
    code, status, title = "slack_signature_invalid", 401, "Slack signature not valid"


def configured() -> bool:
    return bool(settings.UNWIND_SLACK_BOT_TOKEN and settings.UNWIND_SLACK_CHANNEL
                and settings.UNWIND_SLACK_SIGNING_SECRET)


def api_base() -> str:
    """The Slack API base URL: a deployer's setting only, held to egress's URL rules (http(s), no credentials,
    no control characters) so that a typo cannot send the bot token somewhere unintended."""
    url = settings.UNWIND_SLACK_API_URL
    try:
        egress.origin_of(url)
    except egress.Refused as error:
        raise ImproperlyConfigured(f"UNWIND_SLACK_API_URL {error}") from None
    return url if url.endswith("/") else url + "/"


def client():
    from slack_sdk import WebClient

    return WebClient(token=settings.UNWIND_SLACK_BOT_TOKEN, base_url=api_base(), timeout=10)


# --- the message ----------------------------------------------------------------------------------

def _code(text: str) -> str:
    """Agent text in a code span: escaped for mrkdwn, backticks (which would end the span) turned into quotes."""
    return "`" + agent_text.LINE_BREAKS.sub("⏎", agent_text.slack(text)).replace("`", "'") + "`"


def _line(name: str, text: str) -> str:
    return f"• {_code(name)}: {_code(text)}"


def _prose(text: str) -> str:
    return agent_text.slack_quote(text)


# Slack allows 3,000 characters in a section's text; what the agent wrote is measured as posted (escapes included).
LIMITS = surfaces.Limits(value_chars=300, total_chars=2800, prose_chars=2800, line=_line, prose=_prose)


def message_blocks(request: ApprovalRequest, *, outcome: str = "") -> list[dict]:
    """Block Kit: the preview (tool, target, args, risk, why) and, while it waits, Approve / Reject buttons, only
    when the message shows everything the decision covers; otherwise it says what it left out and links to the
    approval page instead (approvals/surfaces.py). The agent's words are escaped, quoted and labelled as its."""
    preview = request.preview or {}
    shown = surfaces.shown(request, LIMITS)
    texts = shown.texts
    target = preview.get("target") or {}
    args = "\n".join(_line(arg["name"], arg["text"]) for arg in shown.args) or "none"
    what = "Undo with" if request.is_compensation else "Approval needed:"
    money = "".join(f", {amount}" for amount in shown.amounts)
    undo = shown.undo
    if undo:  # Unwind's undo: only the run's goal and whom it acts for are the agent's words (approvals/surfaces.py)
        why = [f"*Why this is asked (Unwind's words)*\nUnwind is undoing step {undo['seq']} "
               f"(`{agent_text.slack(undo['tool'])}`{money}) of this run, and this undo waits for a person."]
        arguments = f"*Arguments Unwind will send* (worked out from step {undo['seq']} and what its tool answered)"
    else:
        why = [f"*The agent's reasoning*\n{_prose(texts['reasoning'])}" if texts["reasoning"] else
               "*The agent's reasoning*\n(none given)"]
        arguments = "*Arguments, as the agent sent them*"
    goals = [f"*{label} (as the agent wrote it)*\n{_prose(texts[key])}"
             for key, label in (("goal", "Step goal"), ("run_goal", "Run goal")) if texts[key]]
    # Why the tool's rules ask a person: the policy's words, then the values it read (the agent's, in a code span).
    reasons = ["*Why a person is asked*\n" + "\n".join(
        f"• {agent_text.slack(line['policy'])}" + (f" — {_code(line['values'])}" if line["values"] else "")
        for line in shown.why)] if shown.why else []
    blocks = [
        {"type": "section", "text": {"type": "mrkdwn", "text": (
            f"*{what} `{preview.get('tool')}`*{money} ({request.risk} risk), request {request.pk}")}},
        {"type": "section", "fields": [
            {"type": "mrkdwn", "text": f"*Target*\n{target.get('type') or 'target'} "
                                       f"{_code(texts['target']) if texts['target'] else '(new)'}"},
            {"type": "mrkdwn", "text": "*On behalf of (the agent says)*\n"
                                       + (_code(texts["on_behalf_of"]) if texts["on_behalf_of"] else "(nobody named)")},
        ]},
        *({"type": "section", "text": {"type": "mrkdwn", "text": text}} for text in reasons),
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{arguments}\n{args}"}},
        *({"type": "section", "text": {"type": "mrkdwn", "text": text}} for text in why + goals),
    ]
    page = settings.UNWIND_BASE_URL.rstrip("/") + reverse("approvals:detail", args=[request.pk])
    if not shown.complete:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": (
            f":warning: {shown.missing} This message cannot show everything this decision covers, so it carries no "
            "buttons: open the approval page to see it all and decide there.")}})
    if outcome:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": outcome[:2900]}]})
        return blocks
    if not shown.complete:
        blocks.append({"type": "actions", "block_id": f"unwind_approval_{request.pk}", "elements": [
            {"type": "button", "action_id": OPEN_ACTION, "url": page, "style": "primary",
             "text": {"type": "plain_text", "text": "Open to decide"}}]})
        return blocks
    value = json.dumps({"approval": request.pk, "args_hash": request.args_hash})
    blocks.append({"type": "actions", "block_id": f"unwind_approval_{request.pk}", "elements": [
        {"type": "button", "action_id": "unwind_approve", "style": "primary", "value": value,
         "text": {"type": "plain_text", "text": "Approve"}},
        {"type": "button", "action_id": "unwind_reject", "style": "danger", "value": value,
         "text": {"type": "plain_text", "text": "Reject"}},
        {"type": "button", "action_id": OPEN_ACTION, "url": page, "text": {"type": "plain_text", "text": "Open"}},
    ]})
    return blocks


def summary(request: ApprovalRequest) -> str:
    return f"Approval needed: {(request.preview or {}).get('tool')} ({request.risk} risk), request {request.pk}"


def on_approval_requested(*, request: ApprovalRequest) -> None:
    """In the request's transaction: the outbox row the sweep posts to Slack."""
    if configured():
        SlackMessage.objects.create(request=request, channel=settings.UNWIND_SLACK_CHANNEL,
                                    next_attempt_at=timezone.now())


def slack_messages_post(*, now=None) -> int:
    """Post due messages. Each try is claimed by a conditional update on its attempt count (and pushed back
    while it runs), so two workers never both post one; a failure is retried with backoff, up to a limit. A
    message whose request no longer waits is not posted (approvals/waiting.py, the rule email follows)."""
    if not configured():
        return 0
    from slack_sdk.errors import SlackClientError

    now = now or timezone.now()
    posted = 0
    due = SlackMessage.objects.filter(posted_at__isnull=True, attempts__lt=MAX_POST_ATTEMPTS,
                                      next_attempt_at__lte=now).values_list("pk", "attempts")[:50]
    for pk, attempts in list(due):
        if SlackMessage.objects.filter(pk=pk, posted_at__isnull=True, attempts=attempts).update(
                attempts=attempts + 1, next_attempt_at=now + timedelta(seconds=min(600, 2 ** (attempts + 1)))) != 1:
            continue
        message = SlackMessage.objects.select_related("request").get(pk=pk)
        request = message.request
        # Decided, withdrawn, voided or expired before it could be posted (an outage, a quick approver, a cancelled
        # run): nobody is asked about it. No next attempt; the reason stays on the row.
        why = no_longer_waiting(request, now=max(now, timezone.now()))
        if why:
            SlackMessage.objects.filter(pk=pk, posted_at__isnull=True).update(
                next_attempt_at=None, last_error=f"not posted: {why}"[:2000])
            log.info("slack message %s not posted: %s", pk, why)
            continue
        try:
            answer = client().chat_postMessage(channel=message.channel, text=summary(request),
                                               blocks=message_blocks(request))
        except (SlackClientError, OSError) as error:
            SlackMessage.objects.filter(pk=pk).update(last_error=f"{error.__class__.__name__}: {error}"[:2000])
            log.warning("slack message %s not posted (attempt %s): %s", pk, attempts + 1, error)
            continue
        SlackMessage.objects.filter(pk=pk).update(ts=answer["ts"], channel=answer.get("channel") or message.channel,
                                                  posted_at=timezone.now(), last_error="")
        posted += 1
        # Decided while the post was on its way: the decision's own refresh found no message to update yet.
        if ApprovalRequest.objects.filter(pk=request.pk).exclude(status=ApprovalStatus.PENDING).exists():
            message_refresh(request.pk)
    return posted


# --- a click --------------------------------------------------------------------------------------

def verify(*, body: bytes, headers) -> None:
    """Slack's v0 signature over the raw body and its timestamp (stale after five minutes): else 401."""
    from slack_sdk.signature import SignatureVerifier

    if not settings.UNWIND_SLACK_SIGNING_SECRET:
        raise SlackSignatureInvalid("Slack is not configured here (no UNWIND_SLACK_SIGNING_SECRET)")
    timestamp, signature = headers.get("X-Slack-Request-Timestamp", ""), headers.get("X-Slack-Signature", "")
    verifier = SignatureVerifier(settings.UNWIND_SLACK_SIGNING_SECRET)
    if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 12 and signature
            and verifier.is_valid(body=body, timestamp=timestamp, signature=signature)):
        raise SlackSignatureInvalid("the request's Slack signature or timestamp is not valid (or is stale)")


def parse_click(payload: str) -> tuple[str, str, int, str] | None:
    """(Slack user id, decision, approval id, args hash) of a block_actions payload; None for the "Open" link
    button (which decides nothing); refused when it is not one."""
    try:
        data = json.loads(payload)
        action = data["actions"][0]
        if action["action_id"] == OPEN_ACTION:
            return None
        value = json.loads(action["value"])
        decision = ACTION_IDS[action["action_id"]]
        return str(data["user"]["id"]), decision, int(value["approval"]), str(value["args_hash"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValidationFailed("not an Unwind approval button click", field="payload") from None


def outcome_text(request: ApprovalRequest) -> str:
    """Where the request stands, in one line, whichever way it was decided (Slack, an email link, the page)."""
    decisions = list(request.decisions.select_related("user").order_by("created_at", "pk"))
    approvers = ", ".join(d.user.get_username() for d in decisions if d.decision == Decision.APPROVE)
    rejecter = next((d.user.get_username() for d in decisions if d.decision == Decision.REJECT), "")
    if request.status == ApprovalStatus.APPROVED:
        return f":white_check_mark: Approved by {approvers}. Unwind runs the action now."
    if request.status == ApprovalStatus.REJECTED:
        return f":x: Rejected by {rejecter}: {agent_text.slack(request.outcome_reason)}"
    if request.status != ApprovalStatus.PENDING:
        return f"{request.status.capitalize()}: {agent_text.slack(request.outcome_reason or 'nothing was approved')}."
    given = sum(d.decision == Decision.APPROVE for d in decisions)
    return f":hourglass: {approvers} approved ({given} of {request.required}); it runs once enough people approve."


def on_request_changed(request_id: int) -> None:
    """In the transaction that decided, voided, expired or withdrew a request: refresh its Slack message after
    the commit (nothing leaves the process for a change that rolls back)."""
    if configured():
        transaction.on_commit(lambda: message_refresh(request_id))


def message_refresh(request_id: int) -> None:
    """Show where the request stands where the buttons were (a failure here changes nothing)."""
    from slack_sdk.errors import SlackClientError

    message = SlackMessage.objects.filter(request_id=request_id).exclude(ts="").select_related("request").first()
    if message is None:
        return
    request = message.request
    outcome = outcome_text(request)
    if request.status == ApprovalStatus.PENDING:  # a quorum still short: the buttons stay for the next person
        blocks = message_blocks(request)
        blocks.insert(-1, {"type": "context", "elements": [{"type": "mrkdwn", "text": outcome[:2900]}]})
    else:
        blocks = message_blocks(request, outcome=outcome)
    try:
        client().chat_update(channel=message.channel, ts=message.ts, text=outcome[:300], blocks=blocks)
    except (SlackClientError, OSError) as error:
        log.warning("slack message of request %s not updated: %s", request.pk, error)
