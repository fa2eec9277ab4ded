"""Typed readers for environment variables.

Each reader fails at start with a sentence that names the variable and says what was wrong, so a
misconfigured deployment never boots half-right.
"""
import json
import os
import re
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false (1/0, yes/no, on/off), not {raw!r}.")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {raw!r}.") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {value}.")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, not {raw!r}.") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {value}.")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_json_object(name: str, default: dict) -> dict:
    """A JSON object (`{"crm": {...}}`), for settings with structure; what is inside is checked where it is used."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a JSON object: {exc}.") from None
    if not isinstance(value, dict):
        raise ImproperlyConfigured(f"{name} must be a JSON object, not {type(value).__name__}.")
    return value


_HEADER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


def env_proxy_ssl_header(name: str) -> tuple[str, str] | None:
    """A header the TLS-terminating proxy sets (`X-Forwarded-Proto`) as Django's SECURE_PROXY_SSL_HEADER.

    Empty means no proxy: Django then trusts only the connection itself. `Header` or `Header: value`
    (the value that marks an HTTPS request, `https` unless given).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    header, _, value = raw.partition(":")
    header, value = header.strip(), value.strip() or "https"
    if not _HEADER_NAME.match(header):
        raise ImproperlyConfigured(f"{name} must be a header name such as X-Forwarded-Proto, not {raw!r}.")
    return "HTTP_" + header.upper().replace("-", "_"), value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip()
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, not {raw!r}.")
    return value


# On PostgreSQL, parameters are bound by the server and a statement is prepared after its 5th use: the
# engine sends the same few statements for every step, and skipping their parsing and planning makes a
# step about 15 % cheaper (bench/README.md). Behind a pooler that cannot keep prepared statements
# (PgBouncer in transaction mode before 1.21), add ?prepare_threshold=none, or ?server_side_binding=false.
POSTGRES_DEFAULTS = {"server_side_binding": True, "prepare_threshold": 5}
_BOOLEAN_OPTIONS = {"server_side_binding"}
_INTEGER_OPTIONS = {"prepare_threshold", "conn_max_age"}


def _option(name: str, key: str, value: str):
    """A query option as the PostgreSQL backend wants it: typed, not as text."""
    if key in _BOOLEAN_OPTIONS:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ImproperlyConfigured(f"{name}: ?{key}= must be true or false, not {value!r}.")
        return value.lower() in ("true", "1")
    if key == "prepare_threshold" and value.lower() == "none":
        return None  # never prepare
    if key in _INTEGER_OPTIONS:
        if not value.isdigit():
            unit = "seconds" if key == "conn_max_age" else "uses (or none)"
            raise ImproperlyConfigured(f"{name}: ?{key}= must be a whole number of {unit}, not {value!r}.")
        return int(value)
    return value


def database_from_url(name: str, url: str, *, base_dir) -> dict:
    """Turn DATABASE_URL into a Django DATABASES entry (sqlite:///path or postgres://...)."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = unquote(parsed.path)
        if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
            path = path.lstrip("/")
        if not path:
            raise ImproperlyConfigured(f"{name} names no SQLite file: {url!r} (try sqlite:///var/unwind.sqlite3).")
        full = path if os.path.isabs(path) else str(base_dir / path)
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": full,
            # IMMEDIATE takes the write lock at BEGIN, so two processes never deadlock upgrading a
            # read lock; WAL lets the web process read while the worker writes.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file (not memory) so worker processes in the crash tests share it; one per test process so
            # test runs side by side in one checkout do not overwrite each other.
            "TEST": {"NAME": str(base_dir / "var" / f"test-{os.getpid()}.sqlite3")},
        }
    if parsed.scheme in {"postgres", "postgresql", "pgsql"}:
        dbname = unquote(parsed.path.lstrip("/"))
        if not dbname:
            raise ImproperlyConfigured(f"{name} names no database: {url!r} (add /dbname at the end).")
        options = {key: _option(name, key, values[-1]) for key, values in parse_qs(parsed.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": dbname,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": options.pop("conn_max_age", 0),
            "OPTIONS": {**POSTGRES_DEFAULTS, **options},
        }
    raise ImproperlyConfigured(
        f"{name} must start with sqlite:/// or postgres://, not {parsed.scheme or url!r}."
    )
