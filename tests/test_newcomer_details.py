"""The small things a newcomer trips over: the words on the run page, the admin's names, the icon, the share link."""
import re

import requests
from django.test import Client

from approvals.models import ApprovalRequest, SlackIdentity
from approvals.services import approval_decide
from tests.helpers import act, open_run
from tests.test_console_scenarios import onboarding_compensated


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_declined_charge_reads_rejected_not_rejectd(tools, django_capture_on_commit_callbacks):
    run = open_run(tools, goal="Buy the annual plan")
    charge = act(run, "payments.charge", {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"})
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=tools.alice, approve=False,
                        reason="the customer asked us to wait")
    page = client_for(tools.oscar).get(f"/console/runs/{run.pk}/").content.decode()
    assert "alice rejected on " in page and "Rejectd" not in page and "rejectd" not in page


def test_the_admin_names_slack_identities_in_the_plural():
    assert SlackIdentity._meta.verbose_name_plural == "Slack identities"


def test_every_page_names_an_icon_that_is_served(live_server):
    login = requests.get(f"{live_server.url}/accounts/login/", timeout=10).text
    icon = re.search(r'<link rel="icon" href="([^"]+)"', login).group(1)
    assert requests.get(f"{live_server.url}{icon}", timeout=10).status_code == 200
    legacy = requests.get(f"{live_server.url}/favicon.ico", timeout=10)  # what browsers ask for on the admin
    assert legacy.status_code == 200 and legacy.url.endswith(icon)


def test_a_new_share_link_takes_the_place_of_its_button_with_a_copy_button(tools):
    run = onboarding_compensated(tools)
    page = client_for(tools.oscar).get(f"/console/runs/{run.pk}/").content.decode()
    form = re.search(r'<form method="post" action="([^"]+)" id="make-share-link">', page)
    assert form and form.group(1).endswith("#new-share-link")  # the page comes back to where the button was
    made = client_for(tools.oscar).post(form.group(1).split("#")[0]).content.decode()
    trail = made[made.index('id="trail"'):]
    link, button = trail.index('id="new-share-link"'), trail.index('id="make-share-link"')
    assert trail.index("Anyone with a share link") < link < button  # where the button was, the button after it
    assert 'data-copy="share-url"' in trail[link:button] and "Make another share link" in trail[button:]
    assert re.search(r'value="http://testserver/console/trail/[\w-]{43}/"', trail[link:button])
