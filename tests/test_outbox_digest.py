"""Issue 38, finding 5: the outbox lists what is (or will be) sent to a person, and says what a digest is.

Past UNWIND_APPROVAL_DIGEST_AFTER requests in the window, each further request for an approver is a digest entry:
an outbox row that is never sent by itself, gathered into that approver's one digest email when it leaves
(approvals/services.py). The console's outbox listed every entry as if it were an email ("In the next digest: …",
"sent"). Read here over a live server as the tenant's operator.
"""
import re

from approvals.models import Notification
from approvals.services import DIGEST, DIGEST_ENTRY, REQUESTED, notifications_send
from tests.helpers import act, open_run
from tests.test_trail import console, live_tools  # noqa: F401 - the live server with the sandbox tools


def charges_past_the_digest(world, settings, count: int = 3) -> None:
    """`count` charges wait for approval; past the first, each approver's requests go into a digest."""
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 1
    settings.UNWIND_APPROVAL_DIGEST_WINDOW = 60
    for number in range(count):
        run = open_run(world, goal=f"Trip {number}")
        charge = act(run, "payments.charge", {"customer": "cus_carol", "amount_cents": 61000 + number,
                                              "currency": "EUR"})
        assert charge.status == "awaiting_approval"


def rows(page: str) -> list[str]:
    return re.findall(r'<li class="outbox-row" data-message="(\d+)">(.*?)</li>', page, re.S)


def test_the_outbox_lists_emails_not_digest_entries(live_tools, settings):  # noqa: F811
    charges_past_the_digest(live_tools, settings)
    entries = list(Notification.objects.filter(kind=DIGEST_ENTRY))
    digests = list(Notification.objects.filter(kind=DIGEST))
    assert entries and digests and len(entries) == 2 * len(digests)  # two further requests per approver
    base = live_tools.live_server.url
    oscar = console(live_tools.live_server, "oscar")

    page = oscar.get(f"{base}/console/outbox/", timeout=10).text
    listed = rows(page)
    emails = Notification.objects.exclude(kind=DIGEST_ENTRY)
    assert sorted(int(pk) for pk, _ in listed) == sorted(emails.values_list("pk", flat=True))
    assert f"{emails.count()} messages" in page
    assert "In the next digest" not in page
    for pk, row in listed:
        kind = Notification.objects.get(pk=pk).kind
        said = "A digest: one email listing the approval requests that wait for this person" in row
        assert said == (kind == DIGEST), (kind, row)
        if kind == DIGEST:
            assert "written when it is sent, with every request waiting by then" in row  # not sent yet
    for entry in entries:  # not an email: no page of its own either
        assert oscar.get(f"{base}/console/outbox/{entry.pk}/", timeout=10).status_code == 404

    # Once sent, a digest's page shows the email as it left, listing each request it carried.
    Notification.objects.filter(kind=DIGEST).update(next_attempt_at=Notification.objects.get(
        pk=digests[0].pk).created_at)
    assert notifications_send() >= len(digests)
    digest = Notification.objects.get(pk=digests[0].pk)
    assert digest.status == "sent" and digest.subject.endswith("2 approval requests waiting for you")
    detail = oscar.get(f"{base}/console/outbox/{digest.pk}/", timeout=10).text
    assert "A digest: one email listing the approval requests" in detail
    assert "written when it is sent" not in detail and "payments.charge, €610.01" in detail
    assert Notification.objects.filter(kind=REQUESTED).count() == len(digests)  # the first, singly, each
