"""Every link followed and every GET form submitted, as each kind of person, on a live server; and each filter,
sort and pager link shows what its label says.

The queue's chips, sorts and pagers once rendered as `??reason=drift` (a `?` written before {% querystring %},
which starts with one), so none of them did anything, and no test had followed a link. Pages are two rows long
here, so every pager has somewhere to go.
"""
import re

import pytest
from django.contrib.auth import get_user_model

from approvals import selectors as approval_selectors
from recovery import views as recovery_views
from recovery.trail import trail_link_create
from sandbox.crawl import crawl, login
from tests.test_console_scenarios import (
    compensation_failed_run, drift_run, email_correction_run, onboarding_compensated, step_failed_run,
)
from tests.helpers import act, open_run

PER_PAGE = 2
PEOPLE = {"alice": "approver", "oscar": "operator", "victor": "viewer", "ada": "admin", "root": "superuser"}
RISK_ORDER = ["critical", "high", "medium", "low"]


@pytest.fixture
def busy(tools, live_server, monkeypatch):
    """A queue with items of three reasons over several pages, runs of every ending, a charge in the inbox."""
    for name in ("QUEUE_PAGE_SIZE", "RUNS_PAGE_SIZE", "OUTBOX_PAGE_SIZE", "POLICY_PAGE_SIZE"):
        monkeypatch.setattr(recovery_views, name, PER_PAGE)
    monkeypatch.setattr(approval_selectors, "INBOX_PAGE_SIZE", PER_PAGE)
    runs = [drift_run(tools), compensation_failed_run(tools), drift_run(tools), compensation_failed_run(tools),
            drift_run(tools), onboarding_compensated(tools), email_correction_run(tools)]
    waiting = open_run(tools, goal="Buy the annual plan")
    act(waiting, "payments.charge", {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"})
    runs += [waiting, step_failed_run(tools)]  # after the others: it lets charges through without a reviewer
    get_user_model().objects.create_superuser("root", "root@example.com", "pw-root")
    trails = [f"/console/trail/{trail_link_create(run=run, user=tools.oscar)[1]}/" for run in runs[:3]]
    tools.trails, tools.base = trails, live_server.url
    return tools


@pytest.mark.parametrize("person", list(PEOPLE))
def test_every_link_and_get_form_answers_and_none_is_doubled(busy, person):
    session = login(busy.base, person, f"pw-{person}")
    result = crawl(busy.base, session, start=("/", *busy.trails))
    assert result.ok, "\n".join(result.problems)
    assert len(result.pages) > (3 if person == "root" else 20), sorted(result.pages)  # it went somewhere


def rows(page: str, label: str) -> list[str]:
    return [" ".join(cell.split()) for cell in re.findall(rf'<td data-label="{label}"[^>]*>(.*?)</td>', page, re.S)]


def text(cell: str) -> str:
    return re.sub(r"<[^>]+>", " ", cell).split()[0] if cell.strip() else ""


def link(page: str, pattern: str) -> str:
    found = re.search(pattern, page, re.S)
    assert found, f"no link matching {pattern!r}"
    return found.group(1).replace("&amp;", "&")


def header(page: str, label: str) -> str:
    return link(page, rf'<th><a href="([^"]+)">{label}</a>')


def pager(page: str, label: str) -> str:
    return link(page, rf'<a href="([^"]+)"[^>]*>{label}')


def test_queue_chips_sorts_and_pager_do_what_they_say(busy):
    oscar = login(busy.base, "oscar", "pw-oscar")
    queue = f"{busy.base}/console/recovery/"
    first = oscar.get(queue).text
    total = int(re.search(r"all reasons · (\d+)", first).group(1))
    assert total == 6
    chips = re.findall(r'<a href="([^"]+)"[^>]*\s+hx-get="[^"]+"[^>]*data-reason="(\w+)">([^<]+?) · <strong>(\d+)',
                       first, re.S)
    assert {reason for _, reason, _, _ in chips} == {"drift", "compensation_failed", "step_failed"}
    for href, reason, label, n in chips:
        assert not href.startswith("??")
        listed, url = [], f"{queue}{href.replace('&amp;', '&')}"
        while url:  # every page of the chip's items: only its reason, as many as it says
            page = oscar.get(url).text
            listed += [re.sub(r"<div.*", "", r).strip() for r in rows(page, "Reason")]
            nxt = re.search(r'<a href="([^"]+)"[^>]*>next →', page)
            url = f"{queue}{nxt.group(1).replace('&amp;', '&')}" if nxt else ""
        assert listed == [label.strip()] * int(n), (reason, listed)
    by_reason = oscar.get(f"{queue}{header(first, 'Reason')}").text
    reasons = [re.sub(r"<div.*", "", r).strip() for r in rows(by_reason, "Reason")]
    assert reasons == sorted(reasons) and "sort=reason" in by_reason
    newest = [int(pk) for pk in re.findall(r'data-item="(\d+)"', oscar.get(f"{queue}?sort=newest").text)]
    oldest_url = f"{queue}{header(first, 'Age')}"
    oldest = [int(pk) for pk in re.findall(r'data-item="(\d+)"', oscar.get(oldest_url).text)]
    assert oldest == sorted(oldest) and newest == sorted(newest, reverse=True) and oldest[0] < newest[0]
    risky = rows(oscar.get(f"{queue}{header(first, 'Risk')}").text, "Risk")
    ranks = [RISK_ORDER.index(text(cell)) for cell in risky]
    assert ranks == sorted(ranks)
    page_two = oscar.get(f"{queue}{pager(first, 'next →')}").text
    assert "page 2 of 3" in page_two and "??" not in page_two
    assert not set(re.findall(r'data-item="(\d+)"', page_two)) & set(re.findall(r'data-item="(\d+)"', first))


def test_runs_status_filter_and_pager_do_what_they_say(busy):
    oscar = login(busy.base, "oscar", "pw-oscar")
    runs = f"{busy.base}/console/runs/"
    first = oscar.get(runs).text
    options = re.findall(r'<option value="(\w+)">([^<]+)</option>', re.search(r'<select name="status".*?</select>',
                                                                               first, re.S).group(0))
    seen = 0
    for value, label in options:
        page = oscar.get(f"{runs}?status={value}").text
        statuses = [re.sub(r"<[^>]+>|·.*", "", cell).strip() for cell in rows(page, "Status")]
        assert all(status == label for status in statuses), (value, statuses)
        seen += int(re.search(r"· (\d+) runs?", page).group(1))
    assert seen == int(re.search(r"· (\d+) runs?", first).group(1))  # the statuses add up to all runs
    older = oscar.get(f"{runs}{pager(first, 'older →')}").text
    assert "page 2 of" in older
    assert not set(re.findall(r'data-run="(\d+)"', older)) & set(re.findall(r'data-run="(\d+)"', first))


def test_a_superuser_without_a_role_is_told_why_the_console_is_empty_and_where_to_go(busy):
    root = login(busy.base, "root", "pw-root")
    landing = root.get(f"{busy.base}/").text
    assert "You have no role in any tenant yet" in landing and "/admin/ledger/membership/add/" in landing
    assert 'href="/console/recovery/"' not in landing  # the navigation offers only what opens
    queue = root.get(f"{busy.base}/console/recovery/").text
    assert "Nothing is waiting" not in queue and "You have no role in any tenant" in queue
