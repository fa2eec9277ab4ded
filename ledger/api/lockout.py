"""What a locked-out login sees: a page for the login forms, an RFC 9457 problem for the API.

django-axes counts failed logins per username and address (settings: UNWIND_LOGIN_FAILURE_LIMIT,
UNWIND_LOGIN_COOLOFF_MINUTES). Its backend refuses a locked-out pair before the password is even checked, so
the right password is refused too until the cool-off ends or an admin deletes the attempt.

DRF's BasicAuthentication calls `authenticate(request=<DRF Request>)`: axes counts the failure and flags that
request object, not the Django request its middleware later looks at. `LockoutAwareBasicAuthentication`
reads the flag where axes left it and answers 429 `locked_out` instead of a plain 401.
"""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from drf_spectacular.authentication import BasicScheme
from rest_framework import authentication, exceptions

from ledger.api.problems import API_PREFIXES, PROBLEM_JSON, problem


def cool_off_seconds() -> int:
    return int(settings.AXES_COOLOFF_TIME.total_seconds())


def lockout_sentence() -> str:
    minutes = settings.UNWIND_LOGIN_COOLOFF_MINUTES
    return (f"Too many failed logins for this username from this address: logins are refused for {minutes} "
            f"minutes, even with the right password, unless an administrator unlocks the account.")


class LockedOut(exceptions.Throttled):
    """A 429 problem with code `locked_out` and Retry-After set to the cool-off."""

    default_code = "locked_out"

    def __init__(self):
        super().__init__(wait=cool_off_seconds(), detail=lockout_sentence(), code="locked_out")


def impossible_username(userid: str) -> bool:
    """A username no account can have (too long, or holding NUL): refused before the database sees it.

    Otherwise PostgreSQL would be asked to look it up and axes to record it, and both refuse NUL bytes and
    axes' username column is 255 long: a 500 for what is only a wrong login.
    """
    User = get_user_model()
    longest = User._meta.get_field(User.USERNAME_FIELD).max_length or 150
    return len(userid) > longest or "\x00" in userid


class LockoutAwareBasicAuthentication(authentication.BasicAuthentication):
    def authenticate_credentials(self, userid, password, request=None):
        if impossible_username(userid):
            raise exceptions.AuthenticationFailed("Invalid username/password.")
        try:
            return super().authenticate_credentials(userid, password, request)
        except exceptions.AuthenticationFailed:
            if getattr(request, "axes_locked_out", False):
                raise LockedOut() from None
            raise


class LockoutAwareBasicScheme(BasicScheme):
    """The OpenAPI schema describes it as the HTTP Basic it is."""

    target_class = "ledger.api.lockout.LockoutAwareBasicAuthentication"


def lockout_response(request, original_response=None, credentials=None) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: the login page's (or admin's) answer once a username+address is locked out."""
    if request.path.startswith(API_PREFIXES):
        body = problem(status=429, code="locked_out", title="Too many failed logins", detail=lockout_sentence(),
                       instance=request.path, retry_after=cool_off_seconds())
        response = JsonResponse(body, status=429, content_type=PROBLEM_JSON)
    else:
        response = render(request, "registration/locked_out.html", {
            "cooloff_minutes": settings.UNWIND_LOGIN_COOLOFF_MINUTES,
            "failure_limit": settings.UNWIND_LOGIN_FAILURE_LIMIT,
        }, status=429)
    response["Retry-After"] = str(cool_off_seconds())
    return response
