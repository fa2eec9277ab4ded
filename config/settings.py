"""Unwind settings: one file, every value read from the environment (see README, "Settings")."""
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from config.env import database_from_url, env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG and not env_bool("UNWIND_INSECURE_DEV_KEY", True):
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = "unwind-dev-only-secret-key-change-me-in-production-0123456789"
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
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
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

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
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
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

# Where links in emails and shared pages point.
UNWIND_BASE_URL = env_str("UNWIND_BASE_URL", "http://127.0.0.1:8000")
# Relative HTTP tool URLs (those starting with "/") are resolved against this address.
UNWIND_TOOL_BASE_URL = env_str("UNWIND_TOOL_BASE_URL", UNWIND_BASE_URL)
# The key Unwind signs its tool requests with (ledger/signing.py); a tool that shares it can check them.
UNWIND_TOOL_SIGNING_KEY = env_str("UNWIND_TOOL_SIGNING_KEY", "") or ("unwind-tool-signing:" + SECRET_KEY)

# Engine.
UNWIND_INLINE_WAIT = env_float("UNWIND_INLINE_WAIT", 5.0, minimum=0)
UNWIND_LEASE_SECONDS = env_float("UNWIND_LEASE_SECONDS", 30.0, minimum=1)
UNWIND_DEFAULT_TOOL_TIMEOUT = env_float("UNWIND_DEFAULT_TOOL_TIMEOUT", 10.0, minimum=0.1)
UNWIND_DEFAULT_MAX_ATTEMPTS = env_int("UNWIND_DEFAULT_MAX_ATTEMPTS", 3, minimum=1)
UNWIND_DEFAULT_BACKOFF = env_float("UNWIND_DEFAULT_BACKOFF", 0.2, minimum=0)
UNWIND_MAX_BACKOFF = env_float("UNWIND_MAX_BACKOFF", 60.0, minimum=0)
UNWIND_SWEEP_INTERVAL = env_float("UNWIND_SWEEP_INTERVAL", 1.0, minimum=0.05)
UNWIND_APPROVAL_TTL = env_int("UNWIND_APPROVAL_TTL", 3600, minimum=1)
# How long a correction trail's share link (no account needed) stays valid, in seconds.
UNWIND_TRAIL_LINK_MAX_AGE = env_int("UNWIND_TRAIL_LINK_MAX_AGE", 7 * 24 * 3600, minimum=60)
UNWIND_THROTTLE_RATE = env_str("UNWIND_THROTTLE_RATE", "6000/min")
# The sandbox world under /sandbox/ (per-tenant worlds, reset and fault injection): opt-in, for the demo and tests.
UNWIND_SANDBOX = env_bool("UNWIND_SANDBOX", False)

# Worker (django-q2). ORM broker by default: no extra server. Set UNWIND_REDIS_URL to use Redis.
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

# Throttle counters live in the cache: per process by default, shared by every web process with Redis.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": UNWIND_REDIS_URL}
    if UNWIND_REDIS_URL else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}

# The API: agents authenticate with "Authorization: Bearer <key>", people with their session or HTTP
# Basic; refusals are RFC 9457 problems; each agent key may make UNWIND_THROTTLE_RATE requests.
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "ledger.api.auth.AgentKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_THROTTLE_CLASSES": ["ledger.api.auth.AgentKeyThrottle"],
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
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
    "loggers": {"unwind": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO"), "propagate": False}},
}
