"""The hot path's statements, written once per model instead of compiled by the ORM on every call.

Every step of every run goes through a handful of statements: lock the chain head, lock the run and take
the step's number, insert the action, move a status, append the audit events (with the attempt rows riding
in that last statement, see `AuditLog.write_at_commit`). Building them with the ORM costs about a
millisecond of CPU each on a small machine, more than PostgreSQL takes to run them (see bench/README.md).
Here an INSERT and a SELECT's column list (with the columns' converters) are built once per model and
cached, and conditions and SET lists are plain string joins; values still go through each field's own
`get_db_prep_save`, and rows read back through the fields' converters, so what is stored and loaded is
exactly what the ORM would store and load, on PostgreSQL and on SQLite alike. `*_statement` builds a
statement without running it, for the caller to send with others.

Only equality (and IS NULL) conditions: anything richer stays with the ORM.
"""
from __future__ import annotations

from functools import lru_cache

from django.db import DEFAULT_DB_ALIAS, connections, models


def _db():
    """The connection itself: `django.db.connection` is a proxy that looks it up again on every attribute,
    which the hot path would do hundreds of times per step."""
    return connections[DEFAULT_DB_ALIAS]


@lru_cache(maxsize=None)
def _q(name: str) -> str:
    return _db().ops.quote_name(name)


@lru_cache(maxsize=None)
def _insert_sql(model: type[models.Model], vendor: str) -> tuple[str, tuple]:
    fields = tuple(f for f in model._meta.concrete_fields if not f.primary_key)
    columns = ", ".join(_q(f.column) for f in fields)
    marks = ", ".join(["%s"] * len(fields))
    return f"INSERT INTO {_q(model._meta.db_table)} ({columns}) VALUES ({marks})", fields


def insert_statement(obj: models.Model) -> tuple[str, list]:
    """The INSERT of one new row (auto primary key) as `obj.save()` would store it, not yet executed."""
    db = _db()
    sql, fields = _insert_sql(type(obj), db.vendor)
    return sql, [f.get_db_prep_save(f.pre_save(obj, True), db) for f in fields]


def insert(obj: models.Model) -> models.Model:
    """INSERT one new row (auto primary key), as `obj.save()` would store it; sets obj.pk. No signals."""
    sql, values = insert_statement(obj)
    db = _db()
    with db.cursor() as cursor:
        cursor.execute(f"{sql} RETURNING {_q(obj._meta.pk.column)}", values)
        obj.pk = cursor.fetchone()[0]
    obj._state.adding = False
    obj._state.db = db.alias
    return obj


def _where(db, meta, where: dict) -> tuple[str, list]:
    """`col = %s AND …` for every `where` item (None: IS NULL; "pk": the primary key; a name ending in "__gte":
    `col >= %s`), with its parameters."""
    conditions, params = [], []
    for name, value in where.items():
        name, at_least = (name[:-5], True) if name.endswith("__gte") else (name, False)
        field = meta.pk if name == "pk" else meta.get_field(name)
        if value is None and not at_least:
            conditions.append(f"{_q(field.column)} IS NULL")
        else:
            conditions.append(f"{_q(field.column)} {'>=' if at_least else '='} %s")
            params.append(field.get_db_prep_value(value, db, prepared=False))
    return " AND ".join(conditions), params


def conditions(model: type[models.Model], where: dict) -> tuple[str, list]:
    """`_where`'s conditions on `model`'s columns, for a statement written by hand."""
    return _where(_db(), model._meta, where)


def update_statement(model: type[models.Model], where: dict, **values) -> tuple[str, list]:
    """UPDATE … SET values WHERE every `where` column equals its value (None: IS NULL), not yet executed."""
    db = _db()
    meta = model._meta
    sets, params = [], []
    for name, value in values.items():
        field = meta.get_field(name)
        sets.append(f"{_q(field.column)} = %s")
        params.append(field.get_db_prep_save(value, db))
    conditions, where_params = _where(db, meta, where)
    return f"UPDATE {_q(meta.db_table)} SET {', '.join(sets)} WHERE {conditions}", params + where_params


def update(model: type[models.Model], where: dict, **values) -> int:
    """`update_statement`, executed; the row count."""
    with _db().cursor() as cursor:
        cursor.execute(*update_statement(model, where, **values))
        return cursor.rowcount


@lru_cache(maxsize=None)
def _select_sql(model: type[models.Model], vendor: str) -> tuple[str, tuple, list, list, str]:
    """`SELECT <every column> FROM <table>`, its fields, the converters its columns need, the fields'
    attribute names and the column list alone, built once per model."""
    db = _db()
    meta = model._meta
    fields = tuple(meta.concrete_fields)
    converters = []
    for i, f in enumerate(fields):
        column = f.get_col(meta.db_table)
        found = db.ops.get_db_converters(column) + f.get_db_converters(db)
        if found:
            converters.append((i, found, column))
    columns = ", ".join(_q(f.column) for f in fields)
    return f"SELECT {columns} FROM {_q(meta.db_table)}", fields, converters, [f.attname for f in fields], columns


def _instance(db, model: type[models.Model], row) -> models.Model:
    """A model instance from a row of `_select_sql`'s columns, each through its field's converters."""
    _, fields, converters, attnames, _ = _select_sql(model, db.vendor)
    row = list(row[:len(fields)])
    for i, found, column in converters:
        value = row[i]
        for converter in found:
            value = converter(value, column, db)
        row[i] = value
    return model.from_db(db.alias, attnames, row)


def columns(model: type[models.Model], alias: str) -> tuple[str, int]:
    """Every column of `model` qualified by the table `alias` (for a join), in `instance`'s order, and how many."""
    fields = model._meta.concrete_fields
    return ", ".join(f"{alias}.{_q(f.column)}" for f in fields), len(fields)


def instance(model: type[models.Model], row) -> models.Model:
    """A model instance from the first `columns(model, …)` values of `row`, through the fields' converters."""
    return _instance(_db(), model, row)


def get(model: type[models.Model], *, lock: bool = False, **where):
    """The one row whose columns equal `where` (None: IS NULL), as a model instance, or None; `lock` takes
    FOR NO KEY UPDATE."""
    db = _db()
    select = _select_sql(model, db.vendor)[0]
    conditions, params = _where(db, model._meta, where)
    locking = " FOR NO KEY UPDATE" if lock and db.features.has_select_for_no_key_update else ""
    with db.cursor() as cursor:
        cursor.execute(f"{select} WHERE {conditions}{locking}", params)
        row = cursor.fetchone()
    return None if row is None else _instance(db, model, row)


def get_also(model: type[models.Model], also: tuple[str, ...], **where) -> tuple[models.Model | None, tuple]:
    """`get`, with the values of the `also` SQL expressions (evaluated on the row) in the same statement."""
    db = _db()
    _, fields, _, _, columns = _select_sql(model, db.vendor)
    conditions, params = _where(db, model._meta, where)
    with db.cursor() as cursor:
        cursor.execute(f"SELECT {columns}, {', '.join(also)} FROM {_q(model._meta.db_table)} WHERE {conditions}",
                       params)
        row = cursor.fetchone()
    return (None, (None,) * len(also)) if row is None else (_instance(db, model, row), tuple(row[len(fields):]))


def increment(model: type[models.Model], pk, field: str, *, also: tuple[str, ...] = ()):
    """`field = field + 1` on the row with this primary key, returning the row as it is after the increment
    (locked for the rest of the transaction, as every UPDATE locks its row) and the values of the `also`
    SQL expressions, evaluated on that row; (None, ()) when there is no such row. One statement instead of
    a locking read and an update."""
    db = _db()
    _, fields, _, _, columns = _select_sql(model, db.vendor)
    meta = model._meta
    column = _q(meta.get_field(field).column)
    returning = ", ".join([columns, *also])
    with db.cursor() as cursor:
        cursor.execute(f"UPDATE {_q(meta.db_table)} SET {column} = {column} + 1 WHERE {_q(meta.pk.column)} = %s"
                       f" RETURNING {returning}", [meta.pk.get_db_prep_value(pk, db)])
        row = cursor.fetchone()
    if row is None:
        return None, ()
    return _instance(db, model, row), tuple(row[len(fields):])


def get_locked(model: type[models.Model], pk) -> models.Model:
    """The row with this primary key, locked for the rest of the transaction (as `select_for_update(no_key=True)
    .get(pk=pk)`, and like it raising DoesNotExist)."""
    obj = get(model, lock=True, pk=pk)
    if obj is None:
        raise model.DoesNotExist(f"{model._meta.verbose_name} {pk} does not exist")
    return obj


def value(model: type[models.Model], name: str, value):
    """`value` as the database takes it in a parameter compared with `model`'s field `name` (a datetime as
    SQLite stores it, say)."""
    return model._meta.get_field(name).get_db_prep_value(value, _db(), prepared=False)


def execute(sql: str, params: list) -> None:
    with _db().cursor() as cursor:
        cursor.execute(sql, params)


def fetch_one(sql: str, params: list):
    with _db().cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


def fetch_all(sql: str, params: list) -> list:
    with _db().cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()
