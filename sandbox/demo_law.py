"""The demo's check that every button obeys the saga law and every sentence matches what happened (issue 38): a
Resume refused once a run began to unwind, and a customer's Stop that says beforehand what else it undoes and
afterwards that she decided. Driven over HTTP as the agent, the operator and the customer would."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import requests

from unwind_client import InFlight, Rejected, Unwound

if TYPE_CHECKING:
    from sandbox.demo import Context


def half_undone(ctx: Context) -> None:
    """Seed 001 with undoing failing too: Resume is refused (409), the undos are retried instead."""
    s = "7 law"
    ctx.fault("licenses.revoke", mode="status", status=503, times=0)
    ctx.fault("email.send", mode="status", status=504, times=0)
    run = ctx.client.run(goal="Onboard Bea Rossi (bea@company.com)", on_behalf_of="hr@company.com")
    ctx.runs[s] = run.id
    user = run.act("hr.create_user", {"email": "bea@company.com", "name": "Bea Rossi"})
    run.act("licenses.provision", {"user_id": user["id"], "sku": "workspace-standard"})
    try:
        run.act("email.send", {"to": "bea@home.example", "subject": "Welcome", "body": "Hi Bea!"})
    except Unwound:
        pass
    ctx.expect(s, "half-undone run waits for a person", "needs_attention", ctx.run_status(run.id))
    ctx.sandbox("POST", "faults/clear", tool="email.send")
    items = requests.get(f"{ctx.base_url}/api/v1/recovery-items", params={"run": run.id}, auth=ctx.operator,
                         timeout=10).json()["results"]
    item = items[0]["id"] if items else 0
    resumed = requests.post(f"{ctx.base_url}/api/v1/recovery-items/{item}/resume", json={"reason": "try again"},
                            auth=ctx.operator, timeout=20)
    ctx.expect(s, "Resume after undoing began", 409, resumed.status_code)
    detail = requests.get(f"{ctx.base_url}/api/v1/recovery-items/{item}", auth=ctx.operator, timeout=10).json()
    offered = {move["name"]: move for move in detail.get("moves", [])}
    ctx.expect(s, "what the item offers instead", "Retry the failed undos",
               offered.get("compensate", {}).get("label"))
    sent = ctx.sandbox("GET", "email/messages?to=bea@home.example")["results"]
    ctx.expect(s, "no welcome email for the deleted account", 0, len(sent))
    ctx.sandbox("POST", "faults/clear", tool="licenses.revoke")
    requests.post(f"{ctx.base_url}/api/v1/recovery-items/{item}/compensate", json={"reason": "revoke works again"},
                  auth=ctx.operator, timeout=20)
    ctx.expect(s, "retrying the undos settles it", "compensated", ctx.run_status(run.id))


def stop_says_what_it_undoes(ctx: Context) -> None:
    """Carol's Stop on a held email before the pivot: the page says it also cancels the flight, then that she
    decided."""
    from sandbox.demo import HOLD

    s = "7 law"
    ctx.hold("email.send", HOLD)
    run = ctx.client.run(goal="Flight to Porto", on_behalf_of="carol@company.com")
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "TP1947", "date": "2027-02-03"})
    try:
        run.act("email.send", {"to": "carol@company.com", "subject": "Your Porto flight", "body": "Booked."},
                timeout=0)
        ctx.expect(s, "Porto confirmation", "held", "sent at once")
        return
    except InFlight as held:
        link = ctx.notice_link(run.id)
        page = requests.get(link, timeout=10) if link else None
        said = "Stopping it also undoes what was done before it: we booked flight TP1947 on 2027-02-03 for Carol."
        ctx.expect(s, "the Stop button says it also cancels the flight", True, bool(page) and said in page.text)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text) if page else None
        form = re.search(r'<form method="post" action="([^"]+/stop/\d+/)"', page.text) if page else None
        if token and form:
            requests.post(ctx.base_url + form.group(1), data={"csrfmiddlewaretoken": token.group(1)},
                          cookies=page.cookies, headers={"Referer": link}, timeout=20)
        try:
            held.wait(timeout=20)
        except Rejected:
            pass
    finally:
        ctx.hold("email.send", None)
    ctx.expect(s, "the flight is cancelled with it", "compensated", ctx.run_status(run.id))
    trail = requests.get(link, timeout=10).text if link else ""
    ctx.expect(s, "her trail says she decided", True,
               "you stopped a later step before it was taken" in trail and "No person needed" not in trail)


def the_law_on_every_button(ctx: Context) -> None:
    """A refused Resume, and a Stop that says what else it undoes (issue 38)."""
    half_undone(ctx)
    stop_says_what_it_undoes(ctx)
