"""The engine's PostgreSQL functions (ledger/engine/fastpath.py calls them): one file per function in this folder, the only
place their current text lives, and what installs them.

Each `<name>.sql` holds one `CREATE OR REPLACE FUNCTION <name>(...)` statement: its body between `$$` and `$$`, its
settings as `SET <setting> = <value>` before `AS`. To change a function, edit its file and run `manage.py migrate`:
after every migrate, `install` (a post_migrate step, `ledger.apps`) compares each function in the database with its
file and installs those that differ. No migration is copied by hand.

`expected_fingerprint` is what the fast path's guard (`fastpath.TRUST`) must find in pg_proc before the audit key is
passed to any of these functions: the md5 of every function's name, body and settings, as pg_proc lists them.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
PREFIX = "unwind_"  # every function whose name starts so (in schema public) is one of the engine's: `fastpath.TRUST`

_HEAD = re.compile(r"CREATE OR REPLACE FUNCTION (unwind_[a-z_]+)\(")
_TRIGGER = re.compile(r"\)\s*RETURNS trigger\b")
_SETTING = re.compile(r"\bSET ([a-z_]+) = ([a-z_0-9]+)\b")


@dataclass(frozen=True)
class Function:
    name: str
    text: str  # the statement, as the file holds it
    body: str  # between the $$: what pg_proc.prosrc holds
    config: str | None  # the settings as pg_proc.proconfig lists them, joined by ","; None without any

    @property
    def trigger(self) -> bool:
        """A trigger's function (`RETURNS trigger`, no arguments): a migration creates the trigger that calls it."""
        return bool(_TRIGGER.search(self.text.partition("$$")[0]))


def parse(name: str, text: str) -> Function:
    """The function `name` as the statement `text` defines it."""
    head, dollar, rest = text.partition("$$")
    body, dollar_end, tail = rest.partition("$$")
    named = _HEAD.match(head)
    if not (named and dollar and dollar_end) or named[1] != name or tail.strip() != ";":
        raise ValueError(f"{name}: one `CREATE OR REPLACE FUNCTION {name}(...) ... AS $$ ... $$;` expected")
    settings = _SETTING.findall(head)
    if len(re.findall(r"\bSET\b", head)) != len(settings):
        raise ValueError(f"{name}: each setting as `SET <name> = <plain value>`")
    return Function(name, text, body, ",".join(f"{k}={v}" for k, v in settings) or None)


def functions(folder: Path | None = None) -> dict[str, Function]:
    """Every function of `folder` (this one unless told), by name."""
    return {path.stem: parse(path.stem, path.read_text(encoding="utf-8"))
            for path in sorted((folder or FOLDER).glob(f"{PREFIX}*.sql"))}


def fingerprint(found: dict[str, Function]) -> str:
    """`fastpath.TRUST`'s fingerprint of these definitions: the md5 of each function's name, body and settings joined
    by ":" (the settings only when there are any), the functions by name joined by "|"."""
    return hashlib.md5("|".join(":".join(filter(None, (f.name, f.body, f.config)))
                                for _, f in sorted(found.items())).encode()).hexdigest()


@lru_cache(maxsize=1)
def expected_fingerprint() -> str:
    """The fingerprint the guard expects: this folder's files as they stood when the process first asked."""
    return fingerprint(functions())


# What the database holds of each: the same columns `fastpath.TRUST` fingerprints, and what is needed to drop it.
INSTALLED = (
    "SELECT p.proname, p.prosrc, pg_catalog.array_to_string(p.proconfig, ','),"
    " pg_catalog.format('public.%I(%s)', p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid))"
    " FROM pg_catalog.pg_proc p WHERE p.pronamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace"
    " AND p.proname OPERATOR(pg_catalog.>=) 'unwind_' AND p.proname OPERATOR(pg_catalog.<) 'unwind`'"
    " ORDER BY p.proname, p.oid"
)


def install(connection, wanted: dict[str, Function] | None = None) -> list[str]:
    """Make the engine's functions in `connection`'s database (PostgreSQL) exactly `wanted` (this folder's files
    unless told): each whose body or settings differ from its file (what the guard fingerprints), or that exists more
    than once (another argument list), is dropped and created from its file, so a file may change a function's
    arguments or answer along with its body; a function of the engine's prefix without a file is dropped (the guard
    fingerprints every one). Arguments changed with the body left as it was are not seen, here or by the guard.
    A trigger's function (no arguments) is replaced in place instead, keeping the trigger a migration made on it.
    One transaction: callers see the old functions or the new ones. Returns the names installed or dropped."""
    from django.db import transaction

    wanted = functions() if wanted is None else wanted
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute(INSTALLED)
        held: dict[str, list[tuple]] = {}
        for name, body, config, signature in cursor.fetchall():
            held.setdefault(name, []).append((body, config or None, signature))
        changed = []
        for name in sorted(set(held) | set(wanted)):
            rows, function = held.get(name, []), wanted.get(name)
            if function and len(rows) == 1 and rows[0][:2] == (function.body, function.config):
                continue
            if function and function.trigger and len(rows) == 1:
                cursor.execute(function.text)  # a trigger's function is replaced in place: dropping it drops the trigger
                changed.append(name)
                continue
            for *_, signature in rows:
                cursor.execute(f"DROP FUNCTION {signature}")  # as pg_catalog names it: public.unwind_…(its types)
            if function:
                cursor.execute(function.text)  # no parameters: the bodies hold "%"
            changed.append(name)
    return changed


def install_after_migrate(using: str, **kwargs) -> None:
    """The post_migrate step: on PostgreSQL, once the ledger's migrations have reached the one that first installed
    these files (before it, the tables the functions name may not exist yet)."""
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    connection = connections[using]
    if connection.vendor != "postgresql":
        return
    if ("ledger", FIRST_INSTALLED_BY) not in MigrationRecorder(connection).applied_migrations():
        return
    install(connection)


FIRST_INSTALLED_BY = "0017_engine_functions_from_files"
