"""Email through the outbox, against a real SMTP server started on 127.0.0.1 inside the test (aiosmtpd).

The outbox row is written in the transaction of the change it announces and sent after commit by
`notifications_send` (the worker's sweep calls it): a rolled-back change sends nothing, a mail-server
outage loses nothing, and no row is ever sent twice.
"""
import asyncio
import re
import socket
import threading
from datetime import timedelta
from email import message_from_bytes
from email.policy import default as default_policy
from urllib.parse import urlsplit

import pytest
from aiosmtpd.controller import Controller
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

import approvals.services
from approvals.models import ApprovalRequest, Notification
from approvals.services import approval_decide, approvals_expire, notifications_send
from ledger.models import Action
from ledger.engine.runs import run_cancel, run_compensate
from tests.helpers import act, open_run

CHARGE = {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR"}


class Collector:
    """An aiosmtpd handler that keeps every message it accepts."""

    def __init__(self, delay: float = 0.0):
        self.envelopes = []
        self.delay = delay

    async def handle_DATA(self, server, session, envelope):
        if self.delay:
            await asyncio.sleep(self.delay)
        self.envelopes.append(envelope)
        return "250 Message accepted for delivery"


class SmtpServer:
    """A real SMTP server on a free local port that can go down and come back on the same port."""

    def __init__(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.handler = Collector()
        self.controller = None

    def start(self):
        self.controller = Controller(self.handler, hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def stop(self):
        self.controller.stop()
        self.controller = None

    @property
    def messages(self):
        return [message_from_bytes(e.original_content, policy=default_policy) for e in self.handler.envelopes]


@pytest.fixture
def smtp(settings):
    server = SmtpServer()
    server.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = server.port
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_USE_TLS = False
    settings.EMAIL_TIMEOUT = 5
    yield server
    if server.controller is not None:
        server.stop()


def charge_waiting(world, customer="cus_ana") -> ApprovalRequest:
    run = open_run(world, goal=f"Book the Lisbon trip for {customer}")
    action = act(run, "payments.charge", {**CHARGE, "customer": customer},
                 intent={"goal": "pay", "reasoning": "the holds are in place", "confidence": 0.8})
    assert action.status == "awaiting_approval"
    return ApprovalRequest.objects.get(action=action)


def detail_link(settings, approval: ApprovalRequest) -> str:
    return f"{settings.UNWIND_BASE_URL.rstrip('/')}/approvals/{approval.pk}/"


def body_parts(message) -> tuple[str, str]:
    assert message.get_content_type() == "multipart/alternative"
    return message.get_body(("plain",)).get_content(), message.get_body(("html",)).get_content()


def test_approval_requested_mail_arrives_with_text_html_and_a_working_link(tools, smtp, settings):
    approval = charge_waiting(tools)
    assert smtp.messages == []  # written to the outbox only; the worker sends it
    assert notifications_send() == 4  # one email per approver: each carries links made for that person alone
    assert sorted(e.rcpt_tos for e in smtp.handler.envelopes) == [
        ["ada@example.com"], ["alice@example.com"], ["ben@example.com"], ["oscar@example.com"]]
    message = next(m for m in smtp.messages if m["To"] == "alice@example.com")
    assert message["Subject"].strip() == "[Unwind] Approval needed: payments.charge, €482.00 (high risk)"  # folded: non-ASCII
    text, html = body_parts(message)
    link = detail_link(settings, approval)
    assert link in text and f'href="{link}"' in html
    assert "amount_cents: €482.00 (48200 as sent)" in text and "the holds are in place" in text and "carol@example.com" in text
    assert "<code>amount_cents</code>: <code>€482.00 (48200 as sent)</code>" in html
    note = Notification.objects.get(kind="approval_requested", recipients=["alice@example.com"])
    assert (note.status, note.attempts, note.last_error) == ("sent", 1, "") and note.sent_at is not None
    assert notifications_send() == 0 and len(smtp.messages) == 4

    # The link opens the detail page after logging in.
    path = urlsplit(link).path
    browser = Client(enforce_csrf_checks=True)
    first = browser.get(path)
    assert first.status_code == 302 and first["Location"] == f"/accounts/login/?next={path}"
    login_page = browser.get(first["Location"])
    assert login_page.status_code == 200
    logged_in = browser.post("/accounts/login/", {
        "username": "alice", "password": "pw-alice", "next": path,
        "csrfmiddlewaretoken": browser.cookies["csrftoken"].value})
    assert logged_in.status_code == 302 and logged_in["Location"] == path
    page = browser.get(path)
    assert page.status_code == 200 and "<code>payments.charge</code>" in page.content.decode()


def test_a_rolled_back_change_sends_nothing(tools, smtp):
    run = open_run(tools)
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            act(run, "payments.charge", CHARGE)
            assert Notification.objects.filter(kind="approval_requested").count() == 4  # same transaction
            raise RuntimeError("the change fails after its outbox row was written")
    assert not Notification.objects.exists() and not ApprovalRequest.objects.exists()
    assert notifications_send() == 0
    assert smtp.messages == []


def test_a_mail_server_outage_loses_nothing_and_the_mail_arrives_once(tools, smtp, settings):
    smtp.stop()
    approval = charge_waiting(tools)
    assert notifications_send() == 0
    note = Notification.objects.get(kind="approval_requested", recipients=["alice@example.com"])
    assert note.status == "pending" and note.attempts == 1 and note.sent_at is None
    assert note.last_error and note.next_attempt_at > timezone.now()
    assert notifications_send() == 0  # not due again before its backoff
    note.refresh_from_db()
    assert note.attempts == 1

    smtp.start()
    assert notifications_send(now=timezone.now() + timedelta(seconds=10)) == 4
    assert notifications_send(now=timezone.now() + timedelta(hours=1)) == 0
    message = next(m for m in smtp.messages if m["To"] == "alice@example.com")
    assert len(smtp.messages) == 4
    assert detail_link(settings, approval) in body_parts(message)[0]
    note.refresh_from_db()
    assert (note.status, note.attempts, note.last_error) == ("sent", 2, "")


def test_a_second_sender_never_sends_a_row_the_first_has_claimed(tools, smtp, monkeypatch, settings):
    """Sender B runs while sender A is in the middle of sending; both listed the same due rows."""
    approvals_waiting = [charge_waiting(tools, customer=f"cus_{n}") for n in range(3)]
    second = {}

    class RacingMessage(approvals.services.EmailMultiAlternatives):
        def send(self, fail_silently=False):
            if "sent" not in second:
                second["sent"] = None
                second["sent"] = notifications_send()  # B, between A's listing and A's other claims
            return super().send(fail_silently=fail_silently)

    monkeypatch.setattr(approvals.services, "EmailMultiAlternatives", RacingMessage)
    first = notifications_send()
    assert (first, second["sent"]) == (1, 11)  # 3 requests x 4 approvers
    sent = sorted((re.search(r"http\S+/approvals/\d+/(?!\S)", body_parts(m)[0]).group(0), m["To"]) for m in smtp.messages)
    approvers = ["ada@example.com", "alice@example.com", "ben@example.com", "oscar@example.com"]
    assert sent == sorted((detail_link(settings, a), to) for a in approvals_waiting for to in approvers)  # each once
    assert set(Notification.objects.values_list("status", "attempts")) == {("sent", 1)}


@pytest.mark.django_db(transaction=True)
def test_concurrent_senders_send_each_row_exactly_once(tools, smtp, settings):
    """Two workers sweep the outbox at the same moment, with a slow mail server."""
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 100  # one email per request and approver, no digest
    approvals_waiting = [charge_waiting(tools, customer=f"cus_{n}") for n in range(8)]
    smtp.handler.delay = 0.02
    start = threading.Barrier(2)
    counts, errors = [], []

    def sender():
        try:
            start.wait()
            counts.append(notifications_send())
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=sender) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and sum(counts) == 32  # 8 requests x 4 approvers
    sent = sorted((re.search(r"http\S+/approvals/\d+/(?!\S)", body_parts(m)[0]).group(0), m["To"]) for m in smtp.messages)
    approvers = ["ada@example.com", "alice@example.com", "ben@example.com", "oscar@example.com"]
    assert sent == sorted((detail_link(settings, a), to) for a in approvals_waiting for to in approvers)
    assert set(Notification.objects.values_list("status", "attempts")) == {("sent", 1)}


def test_an_expired_request_tells_the_approvers(tools, smtp, settings, django_capture_on_commit_callbacks):
    approval = charge_waiting(tools)
    assert notifications_send() == 4
    later = timezone.now() + timedelta(seconds=tools.acme.approval_ttl_seconds + 1)
    with django_capture_on_commit_callbacks(execute=True):
        assert approvals_expire(now=later) == 1
    assert notifications_send(now=later) == 1
    message = smtp.messages[-1]
    assert message["Subject"].strip() == "[Unwind] Approval expired: payments.charge, €482.00"
    text, html = body_parts(message)
    assert "counts as a rejection" in text and "counts as a rejection" in html
    assert "Unwind undoes the run's earlier steps" in text
    assert detail_link(settings, approval) in text


def test_operators_hear_when_a_compensation_is_refused(tools, smtp, django_capture_on_commit_callbacks):
    approval = charge_waiting(tools)
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=approval, user=tools.alice, approve=True)  # the charge runs after commit
    with django_capture_on_commit_callbacks(execute=True):
        run = approval.run
        run_cancel(run=run, actor="agent:booker", reason="changed plans")
        run_compensate(run=run, actor="user:oscar", reason="refund it")
    refund = ApprovalRequest.objects.get(action__tool__name="payments.refund")
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=refund, user=tools.ben, approve=False, reason="the customer keeps the ticket")
    notifications_send(now=timezone.now() + timedelta(seconds=1))
    by_subject = {m["Subject"]: m for m in smtp.messages}
    charge = Action.objects.get(pk=approval.action_id)
    failed = by_subject[f"[Unwind] Compensation failed: payments.charge in run {charge.run_id}"]
    assert failed["To"] == "ada@example.com, oscar@example.com"  # operators and up
    text, html = body_parts(failed)
    assert "the compensation was rejected: the customer keeps the ticket" in text
    assert f"step {charge.seq}" in html and "alert and continue" in html
