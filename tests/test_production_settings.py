"""Production safety at start: no public key, `check --deploy` clean under the documented settings, HTTPS and CSP.

Settings are read once, at import, so each start-up case runs `manage.py` in a fresh process with exactly
the environment it names (nothing inherited from the test run, which uses the development key).
"""
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION_ENV = ROOT / "docs" / "production.env"
KEY_REFUSAL = "SECRET_KEY must be set"


def manage(*args: str, env: dict) -> subprocess.CompletedProcess:
    clean = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/tmp", **env}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=120)


def documented_production_env(tmp_path: Path) -> dict:
    """docs/production.env as a deployer fills it in: each <secret> its own random value."""
    env = {}
    for line in PRODUCTION_ENV.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition("=")
        env[name] = re.sub(r"<secret>", lambda _: secrets.token_urlsafe(50), value)
    # The documented database server is an example; `check --deploy` parses the URL but needs no connection.
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'deploy-check.sqlite3'}"
    return env


# --- the secret key -------------------------------------------------------------------------------------

def test_the_process_refuses_to_start_without_a_secret_key():
    refused = manage("check", env={"DEBUG": "0"})
    assert refused.returncode != 0
    assert KEY_REFUSAL in refused.stderr and "UNWIND_INSECURE_DEV_KEY=1" in refused.stderr
    assert "Traceback" in refused.stderr and refused.stdout == ""  # it stopped at settings import


def test_the_public_development_key_given_as_secret_key_is_refused_too():
    from config.settings import DEVELOPMENT_SECRET_KEY

    refused = manage("check", env={"DEBUG": "0", "SECRET_KEY": DEVELOPMENT_SECRET_KEY})
    assert refused.returncode != 0 and KEY_REFUSAL in refused.stderr


def test_the_development_key_is_used_only_when_asked_for_by_name():
    asked = manage("check", env={"DEBUG": "0", "UNWIND_INSECURE_DEV_KEY": "1"})
    assert asked.returncode == 0, asked.stderr
    real = manage("check", env={"DEBUG": "0", "SECRET_KEY": secrets.token_urlsafe(50),
                                "UNWIND_AUDIT_KEY": secrets.token_hex(32)})
    assert real.returncode == 0, real.stderr


def test_check_deploy_flags_the_development_key():
    flagged = manage("check", "--deploy", env={"DEBUG": "0", "UNWIND_INSECURE_DEV_KEY": "1"})
    assert "security.W009" in flagged.stderr


# --- check --deploy under the documented production settings -------------------------------------------

def test_check_deploy_passes_under_the_documented_production_settings(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=documented_production_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout
    assert "WARNINGS" not in result.stderr and "ERRORS" not in result.stderr


def test_without_https_check_deploy_names_what_is_missing(tmp_path):
    env = documented_production_env(tmp_path)
    del env["UNWIND_HTTPS"]
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr


# --- HTTPS settings from the environment ----------------------------------------------------------------

def settings_under(env: dict, *names: str) -> dict:
    code = ("import django, json; django.setup(); from django.conf import settings; "
            f"print(json.dumps({{n: getattr(settings, n) for n in {list(names)!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env={
        "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "config.settings",
        "UNWIND_INSECURE_DEV_KEY": "1", **env})
    assert result.returncode == 0, result.stderr
    import json

    return json.loads(result.stdout)


HTTPS = ("SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS",
         "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD", "SECURE_PROXY_SSL_HEADER")


def test_https_is_off_by_default_and_one_switch_turns_it_on():
    assert settings_under({}, *HTTPS) == {
        "SESSION_COOKIE_SECURE": False, "CSRF_COOKIE_SECURE": False, "SECURE_SSL_REDIRECT": False,
        "SECURE_HSTS_SECONDS": 0, "SECURE_HSTS_INCLUDE_SUBDOMAINS": False, "SECURE_HSTS_PRELOAD": False,
        "SECURE_PROXY_SSL_HEADER": None}
    assert settings_under({"UNWIND_HTTPS": "1", "UNWIND_PROXY_SSL_HEADER": "X-Forwarded-Proto"}, *HTTPS) == {
        "SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True, "SECURE_SSL_REDIRECT": True,
        "SECURE_HSTS_SECONDS": 31_536_000, "SECURE_HSTS_INCLUDE_SUBDOMAINS": True, "SECURE_HSTS_PRELOAD": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"]}


def test_each_https_setting_can_be_given_on_its_own():
    got = settings_under({"UNWIND_HTTPS": "1", "SECURE_SSL_REDIRECT": "0", "SECURE_HSTS_SECONDS": "600",
                          "SECURE_HSTS_PRELOAD": "no", "UNWIND_PROXY_SSL_HEADER": "X-Forwarded-Ssl: on"}, *HTTPS)
    assert (got["SECURE_SSL_REDIRECT"], got["SECURE_HSTS_SECONDS"], got["SECURE_HSTS_PRELOAD"]) == (False, 600, False)
    assert got["SESSION_COOKIE_SECURE"] is True
    assert got["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_SSL", "on"]


@pytest.mark.parametrize("name, value, words", [
    ("UNWIND_PROXY_SSL_HEADER", "X Forwarded Proto", "must be a header name"),
    ("SECURE_HSTS_SECONDS", "a year", "must be a whole number"),
    ("SECURE_REFERRER_POLICY", "everyone", "must be one of"),
    ("UNWIND_LOGIN_FAILURE_LIMIT", "0", "must be at least 1"),
])
def test_a_bad_security_setting_stops_the_start_naming_it(name, value, words):
    result = manage("check", env={"UNWIND_INSECURE_DEV_KEY": "1", name: value})
    assert result.returncode != 0 and name in result.stderr and words in result.stderr


def test_behind_the_proxy_plain_http_is_redirected_and_https_gets_hsts(db, settings):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 31_536_000
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    plain = Client().get("/accounts/login/")
    assert plain.status_code == 301 and plain["Location"] == "https://testserver/accounts/login/"
    secure = Client().get("/accounts/login/", HTTP_X_FORWARDED_PROTO="https")
    assert secure.status_code == 200
    assert secure["Strict-Transport-Security"].startswith("max-age=31536000")
    assert Client().get("/healthz").status_code != 301  # a load balancer's plain-HTTP probe still answers


# --- headers on every response --------------------------------------------------------------------------

def directives(response) -> dict[str, list[str]]:
    policy = response["Content-Security-Policy"]
    return {part.split()[0]: part.split()[1:] for part in policy.split(";") if part.strip()}


@pytest.mark.parametrize("path", ["/accounts/login/", "/api/docs/", "/admin/login/", "/api/v1/runs"])
def test_every_response_carries_the_content_security_policy(db, path):
    response = Client().get(path)
    policy = directives(response)
    assert policy["default-src"] == ["'self'"]
    assert "'unsafe-inline'" not in policy["script-src"] and "'unsafe-eval'" not in policy["script-src"]
    assert "'unsafe-inline'" not in policy["style-src"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["form-action"] == ["'self'"]
    assert policy["object-src"] == ["'none'"]
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"


def test_the_api_docs_inline_script_runs_only_by_this_responses_nonce(db):
    def nonce(response) -> str:
        return next(source for source in directives(response)["script-src"] if source.startswith("'nonce-"))[7:-1]

    first, second = Client().get("/api/docs/"), Client().get("/api/docs/")
    body = first.content.decode()
    assert f'<script nonce="{nonce(first)}">' in body
    assert body.count("<script") == 3  # the two Swagger UI bundles from static files, and the nonced one
    assert "<style" not in body  # its page styles come from unwind/swagger.css
    assert nonce(first) != nonce(second)  # a fresh nonce per response


def test_pages_without_inline_script_get_no_nonce(db):
    """A nonce only where a template used it: the rest of the site allows no inline script at all."""
    assert not any(source.startswith("'nonce-") for source in directives(Client().get("/accounts/login/"))["script-src"])


def test_an_api_answer_carries_django_csps_policy_built_once_per_settings(db, settings, monkeypatch):
    """ledger/csp.py keeps the header of a response without a nonce or a decorator: the same string django-csp
    builds from the settings, built again only when the settings change."""
    import ledger.csp
    from csp.utils import build_policy

    agent_answer = Client().get("/api/v1/runs")
    assert agent_answer["Content-Security-Policy"] == build_policy()
    assert "Content-Security-Policy-Report-Only" not in agent_answer  # no report-only policy is configured
    built = []
    monkeypatch.setattr(ledger.csp, "build_policy", lambda **kw: built.append(kw) or build_policy(**kw))
    for _ in range(3):
        assert Client().get("/api/v1/runs")["Content-Security-Policy"] == build_policy()
    assert built == []  # kept from the first answer

    settings.CONTENT_SECURITY_POLICY = {"DIRECTIVES": {"default-src": ["'none'"]}}
    settings.CONTENT_SECURITY_POLICY_REPORT_ONLY = {"DIRECTIVES": {"img-src": ["'self'"]},
                                                     "EXCLUDE_URL_PREFIXES": ["/healthz"]}
    changed = Client().get("/api/v1/runs")
    assert directives(changed)["default-src"] == ["'none'"]
    assert changed["Content-Security-Policy-Report-Only"] == build_policy(report_only=True)
    assert len(built) == 2  # the policy and the report-only one, once each
    assert "Content-Security-Policy-Report-Only" not in Client().get("/healthz")  # its excluded prefix
