"""Unwind settings: one file, every value read from the environment (see README, "Settings")."""
from datetime import timedelta
from pathlib import Path

from csp.constants import NONCE, NONE, SELF
from django.core.exceptions import ImproperlyConfigured

from config.audit_keys import load_audit_keys
from config.env import (
    database_from_url, env_bool, env_choice, env_float, env_int, env_json_object, env_list, env_proxy_ssl_header,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", False)

# --- production safety: the secret key (issue 13) ---------------------------------------------------------
# The development key is public (it is in this file), and everything signed with it can be forged by anyone:
# sessions, password-reset tokens, the default tool-signing key. It is used only when asked for by name
# (`UNWIND_INSECURE_DEV_KEY=1`: `make demo`, `make test`, the chaos and bench harnesses) or under DEBUG; any
# other start without SECRET_KEY stops here. Its "django-insecure-" prefix makes `check --deploy` flag it.
DEVELOPMENT_SECRET_KEY = "django-insecure-unwind-development-key-public-never-use-in-production-0123456789"
SECRET_KEY = env_str("SECRET_KEY", "")
UNWIND_INSECURE_DEV_KEY = env_bool("UNWIND_INSECURE_DEV_KEY", False)
if not SECRET_KEY or SECRET_KEY == DEVELOPMENT_SECRET_KEY:
    if not (DEBUG or UNWIND_INSECURE_DEV_KEY):
        raise ImproperlyConfigured(
            "SECRET_KEY must be set to a long random value when DEBUG is off (generate one with "
            "`python -c \"import secrets; print(secrets.token_urlsafe(50))\"`); for a local demo or the tests "
            "only, UNWIND_INSECURE_DEV_KEY=1 uses the public development key instead."
        )
    SECRET_KEY = DEVELOPMENT_SECRET_KEY
# --- end: the secret key -----------------------------------------------------------------------------------
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "config",  # first, so its runserver (base URLs follow the served port, config/serving.py) is the one used
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_q",
    "django_htmx",
    "ledger",
    "approvals",
    "recovery",
    "sandbox",
    "mcp_gateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "ledger.web_messages.LazyMessageMiddleware",  # Django's, its storage built on first use
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

# --- production safety: logins, HTTPS, Content-Security-Policy (issue 13) -----------------------------------
# django-csp writes the Content-Security-Policy header (through ledger/csp.py, which builds it once per settings);
# django-axes counts failed logins (the login form, the admin and HTTP Basic on the API alike) and refuses a
# locked-out username+address until the cool-off ends or an admin deletes the attempt (Admin → Axes → Access
# attempts). AxesMiddleware stays last: it turns the lockout a backend flagged into the lockout page.
INSTALLED_APPS += ["axes", "csp"]
MIDDLEWARE.insert(MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1, "ledger.csp.CSPMiddleware")
MIDDLEWARE.append("axes.middleware.AxesMiddleware")
# Innermost, so its process_exception sees a view's exception first: a database that stops answering mid-request
# answers 503 with Retry-After (ledger/api/problems.py), never a 500.
MIDDLEWARE.append("ledger.api.problems.DatabaseUnavailableMiddleware")
# Right after the security middleware: a NUL in a path, query or form field is a 400 before anything reads it
# (PostgreSQL refuses NUL in text, which would be a 500).
MIDDLEWARE.insert(MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
                  "ledger.api.problems.NulRefusedMiddleware")
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
UNWIND_LOGIN_FAILURE_LIMIT = env_int("UNWIND_LOGIN_FAILURE_LIMIT", 5, minimum=1)
UNWIND_LOGIN_COOLOFF_MINUTES = env_int("UNWIND_LOGIN_COOLOFF_MINUTES", 15, minimum=1)
AXES_FAILURE_LIMIT = UNWIND_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(minutes=UNWIND_LOGIN_COOLOFF_MINUTES)
# Keyed on the pair, so a guesser from one address cannot lock a person out everywhere, and a person who
# mistypes is not locked out by someone else's guessing. The address is the connection's (REMOTE_ADDR).
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# Attempts made while locked out do not extend the lockout: the cool-off ends when it says it does.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_LOCKOUT_CALLABLE = "ledger.api.lockout.lockout_response"
AXES_VERBOSE = False

# HTTPS. UNWIND_HTTPS=1 says "Unwind is served over HTTPS": secure cookies, redirect plain HTTP to HTTPS, and
# HSTS for a year (subdomains, preload); each setting can still be given on its own. Behind a proxy that ends
# TLS, UNWIND_PROXY_SSL_HEADER names the header it sets (X-Forwarded-Proto) — only if the proxy always
# overwrites it, since a client could send it too.
UNWIND_HTTPS = env_bool("UNWIND_HTTPS", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", UNWIND_HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", UNWIND_HTTPS)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", UNWIND_HTTPS)
# A load balancer's health probe often speaks plain HTTP to the backend.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000 if UNWIND_HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", UNWIND_HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", UNWIND_HTTPS)
SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header("UNWIND_PROXY_SSL_HEADER")
SECURE_CONTENT_TYPE_NOSNIFF = True
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = env_choice("SECURE_REFERRER_POLICY", "same-origin", (
    "no-referrer", "no-referrer-when-downgrade", "origin", "origin-when-cross-origin", "same-origin",
    "strict-origin", "strict-origin-when-cross-origin",
))
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"

# Content-Security-Policy: scripts and styles only from Unwind's own static files (the Swagger UI's
# initialisation is the one inline script, allowed by a per-response nonce), nothing framed, forms post only
# back here. htmx is told not to inject its indicator <style> (templates/base.html); the console's CSS
# carries those rules instead.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],
        "font-src": [SELF],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "frame-ancestors": [NONE],
        "form-action": [SELF],
    },
}
# --- end: logins, HTTPS, Content-Security-Policy -----------------------------------------------------------

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "recovery.context_processors.navigation",
            ],
        },
    },
]

(BASE_DIR / "var").mkdir(exist_ok=True)
DATABASES = {
    "default": database_from_url(
        "DATABASE_URL", env_str("DATABASE_URL", "sqlite:///var/unwind.sqlite3"), base_dir=BASE_DIR
    )
}
# The ASGI web server's PostgreSQL connections per process, from a pool (psycopg_pool, Django's `pool` option; applied
# by config/asgi.py, so worker processes, which fork, keep their own connections). Under ASGI every request runs in a
# thread of its own: without a bound a burst of requests opens as many connections as it has requests, and PostgreSQL
# refuses everyone past max_connections; with it, a request beyond the pool waits for a connection, up to
# UNWIND_DB_POOL_TIMEOUT seconds (then 503 with Retry-After). 0: no pool.
UNWIND_DB_POOL = env_int("UNWIND_DB_POOL", 0, minimum=0)
UNWIND_DB_POOL_TIMEOUT = env_float("UNWIND_DB_POOL_TIMEOUT", 20.0, minimum=0.1)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- production safety: passwords (issue 13): all four of Django's checks, for every form that sets one ---------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
     "OPTIONS": {"min_length": env_int("UNWIND_PASSWORD_MIN_LENGTH", 12, minimum=8)}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# --- end: passwords ----------------------------------------------------------------------------------------
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"  # recovery.views.home: approvers to their inbox, operators to the queue
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "var" / "static"  # where `collectstatic` puts them, for a proxy or CDN in front
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# The pages' CSS and htmx, and the API docs' Swagger UI, are served by the app itself (WhiteNoise) under any
# server and with DEBUG off, straight from the apps' static folders: no collectstatic step, nothing for a
# newcomer to set up.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# Email: console in development, SMTP when EMAIL_HOST is set.
EMAIL_HOST = env_str("EMAIL_HOST", "")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
EMAIL_BACKEND = env_str(
    "EMAIL_BACKEND",
    "django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST else "django.core.mail.backends.console.EmailBackend",
)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "unwind@localhost")
# Where the file backend (django.core.mail.backends.filebased.EmailBackend, what `make demo` uses) writes each
# message as a file; the console's outbox page shows them too.
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(BASE_DIR / "var" / "mail"))

# Where links in emails and shared pages point. `manage.py runserver` makes both follow the port it serves on
# when they are not set, and refuses a loopback UNWIND_BASE_URL on another port (config/serving.py).
UNWIND_BASE_URL = env_str("UNWIND_BASE_URL", "http://127.0.0.1:8000")
# Relative HTTP tool URLs (those starting with "/") are resolved against this address.
UNWIND_TOOL_BASE_URL = env_str("UNWIND_TOOL_BASE_URL", UNWIND_BASE_URL)
# Where HTTP tools may live: scheme://host:port origins, comma-separated. The origin of UNWIND_TOOL_BASE_URL
# is always allowed; any other URL in policy is refused when written and when called (ledger/executors/egress.py).
UNWIND_TOOL_ORIGINS = env_list("UNWIND_TOOL_ORIGINS", [])
# Addresses (CIDRs) a DNS-named tool origin may resolve to although they are not public, e.g. 10.0.0.0/8
# for tools on the deployment's own network. Loopback, link-local and private space are refused otherwise.
UNWIND_TOOL_PRIVATE_NETWORKS = env_list("UNWIND_TOOL_PRIVATE_NETWORKS", [])
# A tool's answer (or snapshot) longer than this is refused, not kept.
UNWIND_TOOL_MAX_RESPONSE_BYTES = env_int("UNWIND_TOOL_MAX_RESPONSE_BYTES", 1024 * 1024, minimum=1024)
# Modules imported at start whose @registry.tool / @registry.reader callables policy may name by key.
UNWIND_PYTHON_TOOL_MODULES = env_list("UNWIND_PYTHON_TOOL_MODULES", [])
# Upstream MCP servers whose tools policy may name (`executor: {kind: mcp, server, tool}`), as a JSON object of
# name → {"url": ..., "headers": {...}} (streamable HTTP, at an allowed tool origin) or {"command": ..., "args":
# [...], "env": {...}} (stdio). Declared here only: policy names a server, never a URL or a command (ledger/executors/mcp.py).
UNWIND_MCP_SERVERS = env_json_object("UNWIND_MCP_SERVERS", {})
# The key Unwind signs its tool requests with (ledger/executors/signing.py); a tool that shares it can check them.
UNWIND_TOOL_SIGNING_KEY = env_str("UNWIND_TOOL_SIGNING_KEY", "") or ("unwind-tool-signing:" + SECRET_KEY)

# Engine.
UNWIND_INLINE_WAIT = env_float("UNWIND_INLINE_WAIT", 5.0, minimum=0)
# The largest fraction of the inline pool one tenant's steps may hold at once (ledger/api/inline.py); a tenant
# at its share has its next step run by the worker (202) instead of queueing for a thread ahead of other tenants.
UNWIND_INLINE_TENANT_SHARE = env_float("UNWIND_INLINE_TENANT_SHARE", 0.5, minimum=0)
if not 0 < UNWIND_INLINE_TENANT_SHARE <= 1:
    raise ImproperlyConfigured(f"UNWIND_INLINE_TENANT_SHARE must be a fraction above 0 and at most 1 (0.5 is half "
                               f"the inline pool), not {UNWIND_INLINE_TENANT_SHARE}.")
UNWIND_LEASE_SECONDS = env_float("UNWIND_LEASE_SECONDS", 30.0, minimum=1)
# How many times the sweep takes over a step whose worker was lost (each time with no outcome recorded) before
# it hands the step to a person instead: a step whose settling keeps killing its worker never loops for good.
UNWIND_MAX_RECLAIMS = env_int("UNWIND_MAX_RECLAIMS", 10, minimum=1)
# On PostgreSQL, a step's proposal and its success are each one call of a database function (ledger/engine/fastpath.py);
# off, they take the Python path every database takes. Only for comparing the two (bench/, tests).
UNWIND_FAST_PATH = env_bool("UNWIND_FAST_PATH", True)
UNWIND_DEFAULT_TOOL_TIMEOUT = env_float("UNWIND_DEFAULT_TOOL_TIMEOUT", 10.0, minimum=0.1)
UNWIND_DEFAULT_MAX_ATTEMPTS = env_int("UNWIND_DEFAULT_MAX_ATTEMPTS", 3, minimum=1)
UNWIND_DEFAULT_BACKOFF = env_float("UNWIND_DEFAULT_BACKOFF", 0.2, minimum=0)
UNWIND_MAX_BACKOFF = env_float("UNWIND_MAX_BACKOFF", 60.0, minimum=0)
# Waiting for a tool that is down (ledger/engine/attempts.py, `patient`): an undo, or a step whose call never left (a
# refused connection), is tried again with a backoff from UNWIND_PATIENT_BACKOFF seconds, doubling, capped at
# UNWIND_MAX_BACKOFF, for as long as UNWIND_RETRY_PATIENCE seconds from its first attempt (past the tool's own
# retry.max_attempts) before a person is asked. 0 asks at once, after the tool's own attempts.
UNWIND_PATIENT_BACKOFF = env_float("UNWIND_PATIENT_BACKOFF", 5.0, minimum=0)
UNWIND_RETRY_PATIENCE = env_float("UNWIND_RETRY_PATIENCE", 900.0, minimum=0)
# PostgreSQL's monthly partitions of the audit events, attempts and checkpoints (ledger/db/partitions.py): how many
# months ahead of this one the sweep keeps created, and how long their upkeep waits for a lock before it gives up
# for this round (so that it never holds up the ledger's writers).
UNWIND_PARTITION_MONTHS_AHEAD = env_int("UNWIND_PARTITION_MONTHS_AHEAD", 3, minimum=1)
UNWIND_PARTITION_LOCK_TIMEOUT = env_float("UNWIND_PARTITION_LOCK_TIMEOUT", 2.0, minimum=0.1)
# How many approval requests an agent may have waiting for people at once, in one run and across its runs: one
# agent cannot flood the approvers. A proposal past either bound is refused (429 too_many_open_approvals) with
# nothing recorded; counted in the database, under the tenant's chain lock, so every web process agrees.
UNWIND_MAX_OPEN_APPROVALS_PER_RUN = env_int("UNWIND_MAX_OPEN_APPROVALS_PER_RUN", 5, minimum=1)
UNWIND_MAX_OPEN_APPROVALS_PER_AGENT = env_int("UNWIND_MAX_OPEN_APPROVALS_PER_AGENT", 20, minimum=1)
# How many waits (GET /api/v1/actions/{id}/wait, MCP unwind_status {wait}) one agent key, or one person, may have
# open at once; one more answers 429 too_many_waits with Retry-After. Counted in the database (ledger.WaitSlot), so
# every web process agrees (ledger/api/waits.py).
UNWIND_MAX_WAITS_PER_AGENT = env_int("UNWIND_MAX_WAITS_PER_AGENT", 20, minimum=1)
UNWIND_SWEEP_INTERVAL = env_float("UNWIND_SWEEP_INTERVAL", 1.0, minimum=0.05)
UNWIND_APPROVAL_TTL = env_int("UNWIND_APPROVAL_TTL", 3600, minimum=1)
# How long a correction trail's share link (no account needed) stays valid, in seconds.
UNWIND_TRAIL_LINK_MAX_AGE = env_int("UNWIND_TRAIL_LINK_MAX_AGE", 7 * 24 * 3600, minimum=60)
# Hold notices (recovery/hold_notices.py) go only to the tenant's known customer addresses, and at most this many
# per agent within the window (seconds), counted in the database under the tenant's chain lock.
UNWIND_HOLD_NOTICES_PER_AGENT = env_int("UNWIND_HOLD_NOTICES_PER_AGENT", 20, minimum=0)
UNWIND_HOLD_NOTICE_WINDOW = env_int("UNWIND_HOLD_NOTICE_WINDOW", 3600, minimum=1)
# Requests per agent key, REST and MCP together (ledger/api/throttle.py): a burst of that many, then that many per
# period on average (GCRA), counted in the database, so the same for any number of web processes.
UNWIND_THROTTLE_RATE = env_str("UNWIND_THROTTLE_RATE", "6000/min")
# How long an approver's emailed approve/reject link stays valid, in seconds: it also dies with its request's expiry.
UNWIND_APPROVAL_LINK_MAX_AGE = env_int("UNWIND_APPROVAL_LINK_MAX_AGE", 24 * 3600, minimum=60)
# Approval emails per approver: after this many requests within the window (seconds), further requests for the same
# person go into one digest email, sent a window after the first of them, instead of one email each.
UNWIND_APPROVAL_DIGEST_AFTER = env_int("UNWIND_APPROVAL_DIGEST_AFTER", 3, minimum=0)
UNWIND_APPROVAL_DIGEST_WINDOW = env_int("UNWIND_APPROVAL_DIGEST_WINDOW", 60, minimum=1)
# Slack (approvals/slack.py): with a bot token and a channel, each approval request is posted there with Approve /
# Reject buttons; Slack's clicks come back to /integrations/slack/interactions/, signed with the signing secret.
# The API base is a deployer's setting only (tests point it at a local stand-in for Slack).
UNWIND_SLACK_BOT_TOKEN = env_str("UNWIND_SLACK_BOT_TOKEN", "")
UNWIND_SLACK_SIGNING_SECRET = env_str("UNWIND_SLACK_SIGNING_SECRET", "")
UNWIND_SLACK_CHANNEL = env_str("UNWIND_SLACK_CHANNEL", "")
UNWIND_SLACK_API_URL = env_str("UNWIND_SLACK_API_URL", "https://slack.com/api/")
# Unwind as an MCP server (/mcp, `manage.py mcp`; docs/mcp.md). A session's run is opened with this idle timeout (at
# most the tenant's run_idle_timeout): a session left idle that long is unwound by the worker's sweep.
UNWIND_MCP_SESSION_IDLE = env_int("UNWIND_MCP_SESSION_IDLE", 900, minimum=60)
# Open MCP sessions per agent (mcp_gateway/sessions.py): an initialize past it ends the agent's least recently used
# session. The sweep removes ended sessions, and idle ones (UNWIND_MCP_SESSION_IDLE) whose run is no longer open.
UNWIND_MCP_MAX_SESSIONS_PER_AGENT = env_int("UNWIND_MCP_MAX_SESSIONS_PER_AGENT", 50, minimum=1)
# The sandbox world under /sandbox/ (per-tenant worlds, reset and fault injection): opt-in, for the demo and tests.
UNWIND_SANDBOX = env_bool("UNWIND_SANDBOX", False)

# --- Audit chain: tamper evidence against someone with database access (issue 13) -----------------------
# The chain is an HMAC keyed outside the database (config/audit_keys.py: UNWIND_AUDIT_KEY or _FILE, older keys
# in UNWIND_AUDIT_OLD_KEYS / UNWIND_AUDIT_OLD_KEY_FILES). Without one, DEBUG or UNWIND_INSECURE_DEV_KEY=1 derives a
# development key from SECRET_KEY; with DEBUG off and neither, the process refuses to start.
UNWIND_AUDIT_KEY_ID, UNWIND_AUDIT_KEYS = load_audit_keys(
    secret_key=SECRET_KEY, allow_dev_key=DEBUG or UNWIND_INSECURE_DEV_KEY)
# Each tenant's chain head is signed (Ed25519, `manage.py audit_keygen`) into one append-only JSON-lines file per
# tenant in UNWIND_AUDIT_EXPORT_DIR, by `manage.py audit_checkpoint` and by the worker's sweep every
# UNWIND_AUDIT_CHECKPOINT_SECONDS; `verify_audit` checks the chain against the newest signed head.
UNWIND_AUDIT_SIGNING_KEY_FILE = env_str("UNWIND_AUDIT_SIGNING_KEY_FILE", "")
UNWIND_AUDIT_PUBLIC_KEY_FILE = env_str("UNWIND_AUDIT_PUBLIC_KEY_FILE", "")
UNWIND_AUDIT_EXPORT_DIR = env_str("UNWIND_AUDIT_EXPORT_DIR", "")
UNWIND_AUDIT_CHECKPOINT_SECONDS = env_float("UNWIND_AUDIT_CHECKPOINT_SECONDS", 300.0, minimum=1)
# Where `manage.py archive` writes segments of settled runs past their retention (docs/archive.md): file:///dir or
# s3://bucket/prefix (UNWIND_ARCHIVE_S3_ENDPOINT_URL for an S3-compatible server other than AWS). Deployer
# configuration only: nothing a request sends reaches a path or a bucket name.
UNWIND_ARCHIVE_URL = env_str("UNWIND_ARCHIVE_URL", "")
UNWIND_ARCHIVE_S3_ENDPOINT_URL = env_str("UNWIND_ARCHIVE_S3_ENDPOINT_URL", "")
UNWIND_ARCHIVE_SEGMENT_RUNS = env_int("UNWIND_ARCHIVE_SEGMENT_RUNS", 1000, minimum=1)
# The share of its time a pass works (0 < pace <= 1): after each segment it rests for what that segment took times
# (1 - pace) / pace, so the database and the cores serve the agents meanwhile (docs/archive.md, "Operating it").
UNWIND_ARCHIVE_PACE = env_float("UNWIND_ARCHIVE_PACE", 1.0, minimum=0.01)
if UNWIND_ARCHIVE_PACE > 1:
    raise ImproperlyConfigured(f"UNWIND_ARCHIVE_PACE is the share of its time a pass works, at most 1, "
                               f"not {UNWIND_ARCHIVE_PACE}.")
if UNWIND_AUDIT_EXPORT_DIR and not (UNWIND_AUDIT_SIGNING_KEY_FILE or UNWIND_AUDIT_PUBLIC_KEY_FILE):
    raise ImproperlyConfigured("UNWIND_AUDIT_EXPORT_DIR needs UNWIND_AUDIT_SIGNING_KEY_FILE (to sign heads) or "
                               "UNWIND_AUDIT_PUBLIC_KEY_FILE (to verify them).")
# --- end of the audit chain block -------------------------------------------------------------------------

# Worker (django-q2). ORM broker by default: no extra server. Set UNWIND_REDIS_URL to use Redis as the broker, its
# only use (the agent-key throttle counts in the database).
UNWIND_WORKERS = env_int("UNWIND_WORKERS", 2, minimum=1)
UNWIND_TASK_TIMEOUT = env_int("UNWIND_TASK_TIMEOUT", 120, minimum=1)
UNWIND_REDIS_URL = env_str("UNWIND_REDIS_URL", "")
Q_CLUSTER = {
    "name": env_str("UNWIND_QUEUE_NAME", "unwind"),
    "workers": UNWIND_WORKERS,
    "timeout": UNWIND_TASK_TIMEOUT,
    "retry": UNWIND_TASK_TIMEOUT + 30,
    "max_attempts": 5,
    "save_limit": 1000,
    "catch_up": False,
    "poll": 0.1,
    "guard_cycle": 0.5,
    "sync": env_bool("UNWIND_TASKS_SYNC", False),
    "orm": "default",
    "ack_failures": True,
    "label": "Tasks",
}
if UNWIND_REDIS_URL:
    Q_CLUSTER.pop("orm")
    Q_CLUSTER["redis"] = UNWIND_REDIS_URL

# The API: agents authenticate with "Authorization: Bearer <key>", people with their session or HTTP
# Basic; refusals are RFC 9457 problems; each agent key may make UNWIND_THROTTLE_RATE requests, counted in the
# database where every web process sees them (ledger/api/throttle.py). Django's cache (each process's own memory)
# holds nothing a request decides from, so there is no CACHES setting.
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "ledger.api.auth.AgentKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
        "ledger.api.lockout.LockoutAwareBasicAuthentication",  # HTTP Basic, locked out like the login form
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_THROTTLE_CLASSES": ["ledger.api.throttle.AgentKeyThrottle"],
    "DEFAULT_PARSER_CLASSES": ["ledger.api.parsers.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "EXCEPTION_HANDLER": "ledger.api.problems.problem_exception_handler",
    # One representation per endpoint (JSON, or Prometheus text for /metrics): no ?format= switch.
    "URL_FORMAT_OVERRIDE": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Unwind API",
    "DESCRIPTION": (
        "The safety layer agents put every state-changing tool call through: a ledger, policy, exactly-once "
        "execution and newest-first compensation. Agents use an API key (Bearer); approval and recovery "
        "endpoints are for people (session or HTTP Basic). Every refusal is an RFC 9457 problem with a stable code."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "PATH_CONVERTER_OVERRIDES": {"id": int, "name": str},
    "ENUM_NAME_OVERRIDES": {
        "ActionStatusEnum": "ledger.models.ActionStatus",
        "RunStatusEnum": "ledger.models.RunStatus",
        "RiskEnum": "ledger.models.Risk",
        "ActionKindEnum": "ledger.models.ActionKind",
        "StatementKindEnum": "recovery.api.STATEMENT_KINDS",
        "RecoveryItemStatusEnum": "recovery.models.ItemStatus",
    },
}

# --- traces and logs (docs/observability.md) ------------------------------------------------------------------
# Traces are configured by the standard OTEL_* variables (ledger/tracing.py) and are off unless
# OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set. Arguments stay out of spans, but for the top-level
# argument fields named here (say "currency,plan"), shown as `unwind.args.<field>`.
UNWIND_TRACE_ARG_FIELDS = env_list("UNWIND_TRACE_ARG_FIELDS", [])
MIDDLEWARE.insert(MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
                  "ledger.tracing.TraceMiddleware")
# UNWIND_LOG_FORMAT=json: one JSON object a line, with trace_id, span_id, run_id and action_id where they apply.
LOG_FORMAT = env_choice("UNWIND_LOG_FORMAT", "plain", ("plain", "json"))

# Every handler redacts link and share tokens, secret query parameters, keys and Slack's secrets from each line
# (ledger/log_redaction.py): a 4xx on an approval link used to log the link, which anyone reading the log could use.
# Django's own handlers (django.utils.log.DEFAULT_LOGGING: runserver's request lines, the DEBUG console, mail to
# ADMINS) are defined again here, as Django defines them, so that they redact too.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"redact": {"()": "ledger.log_redaction.RedactSecrets"},
                "require_debug_true": {"()": "django.utils.log.RequireDebugTrue"},
                "require_debug_false": {"()": "django.utils.log.RequireDebugFalse"}},
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
                   "json": {"()": "ledger.tracing.JsonFormatter"},
                   "django.server": {"()": "django.utils.log.ServerFormatter", "format": "[{server_time}] {message}",
                                     "style": "{"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["redact"]},
                 "django.console": {"class": "logging.StreamHandler", "level": "INFO",
                                    "filters": ["require_debug_true", "redact"]},
                 "django.server": {"class": "logging.StreamHandler", "level": "INFO", "formatter": "django.server",
                                   "filters": ["redact"]},
                 "mail_admins": {"class": "django.utils.log.AdminEmailHandler", "level": "ERROR",
                                 "filters": ["require_debug_false", "redact"]}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
    "loggers": {"unwind": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO"), "propagate": False},
                "django": {"handlers": ["django.console", "mail_admins"], "level": "INFO"},
                "django.server": {"handlers": ["django.server"], "level": "INFO", "propagate": False}},
}
