"""Logins that resist guessing, attacked over real HTTP against a live server.

After UNWIND_LOGIN_FAILURE_LIMIT wrong passwords for one username from one address, the right password is
refused too — on the login form (a page that says so) and on the API's HTTP Basic (a 429 `locked_out`
problem, never a 500) — until the cool-off ends or an admin deletes the attempt in the admin.
"""
import re
import time
from datetime import timedelta

import pytest
import requests
from django.conf import settings
from django.contrib.auth import get_user_model

LOGIN = "/accounts/login/"
APPROVALS_API = "/api/v1/approvals"
ADMIN_PASSWORD = "root-Passphrase-for-tests-7"


@pytest.fixture
def admin(world):
    return get_user_model().objects.create_superuser("root", "root@example.com", ADMIN_PASSWORD)


def csrf_token(session: requests.Session, url: str) -> str:
    page = session.get(url, timeout=10)
    assert page.status_code == 200, page.text
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)


def log_in(base_url: str, username: str, password: str, *, next_url: str = "/approvals/",
           session: requests.Session | None = None) -> tuple[requests.Session, requests.Response]:
    session = session or requests.Session()
    token = csrf_token(session, base_url + LOGIN)
    response = session.post(base_url + LOGIN, timeout=10, allow_redirects=False, headers={"Referer": base_url + LOGIN},
                            data={"username": username, "password": password, "next": next_url,
                                  "csrfmiddlewaretoken": token})
    return session, response


def is_logged_in(session: requests.Session, base_url: str) -> bool:
    return session.get(base_url + "/approvals/", timeout=10, allow_redirects=False).status_code == 200


def admin_unlocks(base_url: str, username: str) -> None:
    """What an administrator does: Admin → Axes → Access attempts → delete the one for that username."""
    from axes.models import AccessAttempt

    session, response = log_in(base_url, "root", ADMIN_PASSWORD, next_url="/admin/")
    assert response.status_code == 302, response.text
    listing = session.get(f"{base_url}/admin/axes/accessattempt/", params={"q": username}, timeout=10)
    assert listing.status_code == 200 and username in listing.text
    attempt = AccessAttempt.objects.get(username=username)
    delete_url = f"{base_url}/admin/axes/accessattempt/{attempt.pk}/delete/"
    token = csrf_token(session, delete_url)
    deleted = session.post(delete_url, data={"post": "yes", "csrfmiddlewaretoken": token}, timeout=10,
                           headers={"Referer": delete_url}, allow_redirects=False)
    assert deleted.status_code == 302, deleted.text
    assert not AccessAttempt.objects.filter(username=username).exists()


def test_the_login_form_locks_out_and_an_admin_unlocks(live_server, admin):
    base = live_server.url
    limit = settings.AXES_FAILURE_LIMIT
    for attempt in range(1, limit):
        session, response = log_in(base, "alice", f"guess-{attempt}")
        assert response.status_code == 200 and "didn't match" in response.text
    session, response = log_in(base, "alice", f"guess-{limit}")
    assert response.status_code == 429 and "Login locked for now" in response.text

    session, response = log_in(base, "alice", "pw-alice")  # the right password, after the limit
    assert response.status_code == 429
    assert "Login locked for now" in response.text and "even with the right password" in response.text
    assert response.headers["Retry-After"] == str(settings.UNWIND_LOGIN_COOLOFF_MINUTES * 60)
    assert not is_logged_in(session, base)

    other, response = log_in(base, "ben", "pw-ben")  # another username from the same address is not affected
    assert response.status_code == 302 and is_logged_in(other, base)

    admin_unlocks(base, "alice")
    session, response = log_in(base, "alice", "pw-alice")
    assert response.status_code == 302 and response.headers["Location"] == "/approvals/"
    assert is_logged_in(session, base)


def test_http_basic_locks_out_with_a_problem_and_an_admin_unlocks(live_server, admin):
    base = live_server.url
    limit = settings.AXES_FAILURE_LIMIT
    for attempt in range(1, limit):
        response = requests.get(base + APPROVALS_API, auth=("alice", f"guess-{attempt}"), timeout=10)
        assert response.status_code == 401 and response.json()["code"] == "authentication_failed"

    for password in (f"guess-{limit}", "pw-alice"):  # the limit-th guess, then the right password
        response = requests.get(base + APPROVALS_API, auth=("alice", password), timeout=10)
        assert response.status_code == 429, response.text
        assert response.headers["Content-Type"] == "application/problem+json"
        problem = response.json()
        assert problem["code"] == "locked_out" and problem["type"] == "urn:unwind:problem:locked_out"
        assert "even with the right password" in problem["detail"]
        assert response.headers["Retry-After"] == str(settings.UNWIND_LOGIN_COOLOFF_MINUTES * 60)

    # The API and the login form share one count: the locked-out pair cannot switch doors.
    session, response = log_in(base, "alice", "pw-alice")
    assert response.status_code == 429 and not is_logged_in(session, base)

    admin_unlocks(base, "alice")
    response = requests.get(base + APPROVALS_API, auth=("alice", "pw-alice"), timeout=10)
    assert response.status_code == 200, response.text


def test_a_success_before_the_limit_resets_the_count(live_server, world):
    """A person who mistypes a few times and then gets it right starts from zero again."""
    base = live_server.url
    limit = settings.AXES_FAILURE_LIMIT
    for round_ in range(2):
        for attempt in range(1, limit):
            log_in(base, "alice", f"typo-{round_}-{attempt}")
        session, response = log_in(base, "alice", "pw-alice")
        assert response.status_code == 302, f"round {round_}: {response.status_code}"


def test_the_lockout_ends_after_the_cool_off(live_server, world, settings):
    settings.AXES_COOLOFF_TIME = timedelta(seconds=2)
    base = live_server.url
    for attempt in range(settings.AXES_FAILURE_LIMIT):
        requests.get(base + APPROVALS_API, auth=("alice", f"guess-{attempt}"), timeout=10)
    locked = requests.get(base + APPROVALS_API, auth=("alice", "pw-alice"), timeout=10)
    assert locked.status_code == 429 and locked.headers["Retry-After"] == "2"
    time.sleep(2.5)
    assert requests.get(base + APPROVALS_API, auth=("alice", "pw-alice"), timeout=10).status_code == 200


@pytest.mark.parametrize("username", ["a" * 300, "ali\x00ce"], ids=["too-long", "nul"])
def test_an_impossible_basic_username_is_a_401_never_a_500(live_server, world, username):
    """No user can have such a name, and the database must not be asked to look it up or store it."""
    from axes.models import AccessAttempt

    response = requests.get(live_server.url + APPROVALS_API, auth=(username, "pw-alice"), timeout=10)
    assert response.status_code == 401, response.text
    assert response.json()["code"] == "authentication_failed"
    assert not AccessAttempt.objects.exclude(username="alice").exists()
