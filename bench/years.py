"""Part 9: a ledger that lives for years (issue 42) — N actions loaded in bulk, then what they cost and how the
console and `verify_audit` fare at that size.

The rows are cloned, with COPY, from one real saga (seed 001's onboarding, three steps that succeed, run through the
services in the same tenant): its run, steps, attempts, checkpoint and audit events, so that every row has the size
and shape the engine writes. Each clone gets its own ids, idempotency keys and times (spread evenly over
BENCH_YEARS_MONTHS months back from now, so that PostgreSQL's monthly partitions each hold their share), and its audit
events are appended to the tenant's chain as ledger/audit/chain.py appends them: each event's HMAC over the previous
one's under the configured audit key, its seals (`sends`, `undo`) computed from the cloned step, and the last
fingerprint of each step and of the run computed from the cloned row, so `verify_audit` verifies the whole chain.
What is not recomputed: the fingerprint an earlier event of a step (its proposal) carries of the row as it stood
then, which `verify_audit` does not compare with anything (only a row's last one is); those are the template's.

Measured: bytes per action hot (pg_total_relation_size of the ledger's tables, every partition, with indexes and
TOAST, over the actions), each table's share, the console's pages' p95 (Django's test client, an operator with a
session, as part 4) for the run list, a recent run and the oldest run, and `verify_chain`'s time over the whole chain.
Then `archive_part`: archive throughput (actions/s, in all and while working) with `manage.py archive --pace`
(BENCH_YEARS_ARCHIVE_PACE, 0.25: it works a quarter of its time) over the older half, the saga's p50
while it runs against just before, the bytes per action kept hot after it and archived, and `verify_chain` over hot
and archived (issue 42).

Settings: BENCH_YEARS_N (actions; 1,000,000, or 1,000 under BENCH_QUICK: the issue's 10,000,000 is
BENCH_YEARS_N=10000000, over an hour here, most of it `verify_chain` walking 30 million events twice at ~18,000 a
second), BENCH_YEARS_MONTHS (12),
BENCH_YEARS_DB (`<BENCH_DB>_years`, dropped and created afresh), BENCH_PAGE_REQUESTS (30; 5 quick).
`.venv/bin/python -m bench.years` runs this part alone and prints its results as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone as dt_timezone

from bench.common import BENCH_DB, QUICK, ROOT, log, summary

TENANT = "years"
YEARS_DB = os.environ.get("BENCH_YEARS_DB") or f"{BENCH_DB}_years"
BATCH_RUNS = 5000
TABLES = ("ledger_run", "ledger_action", "ledger_attempt", "ledger_checkpoint", "ledger_auditevent")


def settings_from_env() -> dict:
    return {"n": int(os.environ.get("BENCH_YEARS_N") or (1_000 if QUICK else 1_000_000)),
            "months": int(os.environ.get("BENCH_YEARS_MONTHS") or 12),
            "requests": int(os.environ.get("BENCH_PAGE_REQUESTS") or (5 if QUICK else 30))}


class Template:
    """The real saga every clone copies: its rows as model instances and as the values COPY writes."""

    def __init__(self, tenant):
        from ledger.models import Action, Attempt, AuditEvent, Checkpoint, Run

        self.run = Run.objects.filter(tenant=tenant).order_by("-id").first()
        self.actions = list(Action.objects.filter(run=self.run).order_by("seq"))
        self.attempts = list(Attempt.objects.filter(action__run=self.run).order_by("action_id", "number"))
        self.checkpoints = list(Checkpoint.objects.filter(run=self.run).order_by("id"))
        self.events = list(AuditEvent.objects.filter(tenant=tenant, run_ref=self.run.pk).order_by("seq"))
        assert self.actions and self.events, "the template saga left no rows"
        # Which event is the last to fingerprint each step and the run: those fingerprints are checked, so clones
        # get their own.
        self.last_action_event, self.last_run_event = {}, None
        for index, event in enumerate(self.events):
            if event.action_ref is not None and "action_state" in event.data:
                self.last_action_event[event.action_ref] = index
            if "run_state" in event.data:
                self.last_run_event = index


class Rows:
    """A model's columns for COPY and a template row's prepared values; a clone changes only its ids and times."""

    def __init__(self, obj, connection, changed: tuple[str, ...]):
        self.fields = list(obj._meta.concrete_fields)
        self.columns = ", ".join(f.column for f in self.fields)
        self.values = [f.get_db_prep_save(getattr(obj, f.attname), connection) for f in self.fields]
        names = [f.attname for f in self.fields]
        self.times = [(names.index(f.attname), f.attname) for f in self.fields
                      if isinstance(getattr(obj, f.attname), datetime)]
        self.changed = [(names.index(name), name) for name in changed]
        self.by_name = {f.attname: f for f in self.fields}

    def row(self, clone, connection) -> list:
        values = list(self.values)
        for index, name in self.times:
            values[index] = getattr(clone, name)
        for index, name in self.changed:
            values[index] = self.by_name[name].get_db_prep_save(getattr(clone, name), connection)
        return values


def _shifted(obj, shift: timedelta):
    """A copy of a model instance (no deep copy: clones only replace values) with every time moved by `shift`."""
    clone = obj.__class__.__new__(obj.__class__)
    clone.__dict__.update(obj.__dict__)
    for name, value in obj.__dict__.items():
        if isinstance(value, datetime):
            clone.__dict__[name] = value + shift
    return clone


def _ids(value, mapping):
    if isinstance(value, list):
        return [mapping.get(v, v) if isinstance(v, int) else v for v in value]
    return value


def prepare_months(first: datetime, last: datetime) -> None:
    """Create the month partitions the loaded rows fall in (PostgreSQL, after migration 0028), so that none lands
    in a DEFAULT partition."""
    from django.db import connection, transaction

    from ledger.db import partitions

    with transaction.atomic(), connection.cursor() as cursor:
        month = partitions.month_of(first)
        while month <= partitions.month_of(last):
            for table in partitions.PARTITIONED:
                if partitions.is_partitioned(cursor, table):
                    partitions.create_month(cursor, table, month)
            month = partitions.add_months(month, 1)


def load(tenant, n: int, *, months: int, now: datetime | None = None) -> dict:
    """Clone the tenant's newest run until about `n` more actions are in the ledger (whole runs). Returns figures."""
    from django.conf import settings
    from django.db import connection, transaction

    from bench.scale import reserve
    from ledger.audit.chain import action_fingerprint, dumps, event_hash, run_fingerprint, seal, undo_seal
    from ledger.models import Action, Attempt, AuditEvent, AuditHead, Checkpoint, Run

    t = Template(tenant)
    per_run = len(t.actions)
    runs = max(1, n // per_run)
    now = now or datetime.now(dt_timezone.utc)
    first = now - timedelta(days=30 * months)
    step = (now - first - timedelta(minutes=5)) / runs
    prepare_months(first, now)
    key_id = settings.UNWIND_AUDIT_KEY_ID
    key = settings.UNWIND_AUDIT_KEYS[key_id]
    changed = {Run: ("id",), Action: ("id", "run_id", "idempotency_key", "compensates_id", "repeat_of_id"),
               Attempt: ("id", "action_id"), Checkpoint: ("id", "run_id", "state")}
    # One per template row: the steps (and their attempts) of the saga differ in their values.
    shape = {id(obj): Rows(obj, connection, changed[type(obj)])
             for obj in (t.run, *t.actions, *t.attempts, *t.checkpoints)}
    columns = {type(obj): shape[id(obj)].columns for obj in (t.run, *t.actions, *t.attempts, *t.checkpoints)}
    with connection.cursor() as cursor:  # bytea since migration 0032 (ledger/models.py HexDigestField), text before
        cursor.execute("SELECT data_type FROM information_schema.columns WHERE table_name = 'ledger_auditevent'"
                       " AND column_name = 'hash'")
        as_bytes = cursor.fetchone()[0] == "bytea"

    def digest_value(hex_digest: str):
        return bytes.fromhex(hex_digest) if as_bytes else hex_digest

    event_columns = ("tenant_id", "seq", "kind", "actor", "run_ref", "action_ref", "data", "created_at", "prev_hash",
                     "hash", "key_id")
    started = time.perf_counter()
    hashing = 0.0
    done = 0
    while done < runs:
        count = min(BATCH_RUNS, runs - done)
        rows = {Run: [], Action: [], Attempt: [], Checkpoint: []}
        events = []
        with transaction.atomic(), connection.cursor() as django_cursor:
            head = AuditHead.objects.select_for_update().get(pk=tenant.pk)
            seq, prev = head.seq, head.hash
            run0 = reserve(django_cursor.cursor, Run, count)
            action0 = reserve(django_cursor.cursor, Action, count * per_run)
            attempt0 = reserve(django_cursor.cursor, Attempt, count * len(t.attempts)) if t.attempts else 0
            checkpoint0 = reserve(django_cursor.cursor, Checkpoint, count * len(t.checkpoints)) if t.checkpoints else 0
            tick = time.perf_counter()
            for j in range(count):
                i = done + j
                shift = first + step * i - t.run.created_at
                run = _shifted(t.run, shift)
                run.pk = run.id = run0 + j
                rows[Run].append(shape[id(t.run)].row(run, connection))
                ids = {t.run.pk: run.pk}
                clones = {}
                for k, template_action in enumerate(t.actions):
                    action = _shifted(template_action, shift)
                    action.pk = action.id = action0 + j * per_run + k
                    action.run_id = run.pk
                    action.idempotency_key = f"{template_action.idempotency_key[:200]}.{i}"
                    ids[template_action.pk] = action.pk
                    clones[template_action.pk] = action
                for template_action in t.actions:
                    action = clones[template_action.pk]
                    action.compensates_id = ids.get(action.compensates_id, action.compensates_id)
                    action.repeat_of_id = ids.get(action.repeat_of_id, action.repeat_of_id)
                    rows[Action].append(shape[id(template_action)].row(action, connection))
                for k, template_attempt in enumerate(t.attempts):
                    attempt = _shifted(template_attempt, shift)
                    attempt.pk = attempt.id = attempt0 + j * len(t.attempts) + k
                    attempt.action_id = ids[template_attempt.action_id]
                    rows[Attempt].append(shape[id(template_attempt)].row(attempt, connection))
                for k, template_checkpoint in enumerate(t.checkpoints):
                    checkpoint = _shifted(template_checkpoint, shift)
                    checkpoint.pk = checkpoint.id = checkpoint0 + j * len(t.checkpoints) + k
                    ids[template_checkpoint.pk] = checkpoint.pk
                    checkpoint.run_id = run.pk
                    checkpoint.state = {name: _ids(value, ids) if name.endswith("_ids") else value
                                        for name, value in template_checkpoint.state.items()}
                    rows[Checkpoint].append(shape[id(template_checkpoint)].row(checkpoint, connection))
                for index, template_event in enumerate(t.events):
                    data = dict(template_event.data)
                    action = clones.get(template_event.action_ref)
                    if action is not None and "sends" in data:
                        data["sends"] = seal(action)
                    if action is not None and "undo" in data:
                        data["undo"] = undo_seal(action)
                    if action is not None and t.last_action_event.get(template_event.action_ref) == index:
                        data["action_state"] = action_fingerprint(action)
                    if index == t.last_run_event:
                        data["run_state"] = run_fingerprint(run)
                    if "checkpoint" in data:
                        data["checkpoint"] = ids.get(data["checkpoint"], data["checkpoint"])
                    text = dumps(data)
                    data = json.loads(text)
                    at = template_event.created_at + shift
                    run_ref = ids.get(template_event.run_ref, template_event.run_ref)
                    action_ref = None if action is None else action.pk
                    seq += 1
                    h = event_hash(key, prev, key_id=key_id, tenant_id=tenant.pk, seq=seq, kind=template_event.kind,
                                   actor=template_event.actor, run_ref=run_ref, action_ref=action_ref, data=data,
                                   created_at=at)
                    events.append((tenant.pk, seq, template_event.kind, template_event.actor, run_ref, action_ref,
                                   text, at, digest_value(prev), digest_value(h), key_id))
                    prev = h
            hashing += time.perf_counter() - tick
            cursor = django_cursor.cursor
            for model, values in rows.items():
                if not values:
                    continue
                with cursor.copy(f"COPY {model._meta.db_table} ({columns[model]}) FROM STDIN") as copying:
                    for row in values:
                        copying.write_row(row)
            with cursor.copy(f"COPY {AuditEvent._meta.db_table} ({', '.join(event_columns)}) FROM STDIN") as copying:
                for row in events:
                    copying.write_row(row)
            AuditHead.objects.filter(pk=tenant.pk).update(seq=seq, hash=prev)
        done += count
        if done % (BATCH_RUNS * 20) == 0 or done == runs:
            log(f"years: {done * per_run:,} actions loaded ({time.perf_counter() - started:.0f} s)")
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"ANALYZE {table}")
    seconds = time.perf_counter() - started
    return {"runs": runs, "actions": runs * per_run, "events": runs * len(t.events), "load_s": round(seconds, 1),
            "hashing_s": round(hashing, 1), "actions_per_s": round(runs * per_run / seconds)}


def sizes(actions: int) -> dict:
    """Bytes on disk of each ledger table (every partition, indexes, TOAST) and in all, per action."""
    from django.db import connection

    out = {}
    with connection.cursor() as cursor:
        for table in TABLES:
            # A partitioned table's own size is 0 (its partitions hold the rows), and pg_partition_tree lists nothing
            # for a table that is not partitioned.
            cursor.execute("SELECT CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum(pg_total_relation_size(relid)),"
                           " 0) FROM pg_partition_tree(c.oid) WHERE isleaf) ELSE pg_total_relation_size(c.oid) END"
                           " FROM pg_class c WHERE c.oid = to_regclass(%s)", [table])
            out[table] = int(cursor.fetchone()[0])
    total = sum(out.values())
    return {"bytes": out, "total_bytes": total, "bytes_per_action": round(total / max(actions, 1))}


def pages(user, runs: dict[str, int], requests: int) -> dict:
    from bench.common import page_times

    return page_times(user, {"run list": "/console/runs/",
                             **{f"run page ({name})": f"/console/runs/{pk}/" for name, pk in runs.items()}}, requests)


def verify(tenant) -> dict:
    from ledger.audit.verify import verify_chain

    started = time.perf_counter()
    report = verify_chain(tenant.pk)
    seconds = time.perf_counter() - started
    return {"ok": report.ok, "events": report.events, "seconds": round(seconds, 1),
            "events_per_s": round(report.events / seconds), "problem": report.problem}


def archive_part(tenant, months: int) -> dict:
    """Archive throughput and what it costs a saga meanwhile (issue 42), then the hot bytes left and the chain
    verified hot + archived. A retention of half the loaded span makes the older half due; `manage.py archive` (a
    child process, as a deployment schedules it) moves up to BENCH_YEARS_ARCHIVE_RUNS of them (20,000; every due one
    under BENCH_QUICK) to segments in a folder. Meanwhile this process times the onboarding saga of part 1 in another
    tenant, against the same saga timed just before the archive started: the same process, minutes apart."""
    import re
    import tempfile
    from pathlib import Path

    from bench.common import bench_env
    from bench.engine import Saga, tenant_with_tools
    from ledger.audit.export import generate_key_pair
    from ledger.models import Action, Tenant
    from ledger.policy.versions import tenant_defaults_set

    folder = Path(tempfile.mkdtemp(prefix="unwind-years-archive-"))
    key_file = folder / "signing.pem"
    key_file.write_bytes(generate_key_pair()[0])
    tenant_defaults_set(tenant=tenant, values={"retention_seconds": months * 30 * 86400 // 2}, actor="bench")
    limit = os.environ.get("BENCH_YEARS_ARCHIVE_RUNS") or ("" if QUICK else "20000")
    saga_tenant, agent, _ = tenant_with_tools(f"{TENANT}-saga")
    saga = Saga(saga_tenant, agent)
    baseline_n = 10 if QUICK else 100

    def timed(i: int) -> float:
        started = time.perf_counter()
        assert saga.onboard(i, False) == "completed"
        return time.perf_counter() - started

    for i in range(5):
        timed(i)  # warm
    before = [timed(i) for i in range(baseline_n)]
    env = bench_env(UNWIND_ARCHIVE_URL=f"file://{folder / 'segments'}", UNWIND_AUDIT_SIGNING_KEY_FILE=str(key_file),
                    BENCH_DB=os.environ.get("BENCH_DB", ""))
    pace = os.environ.get("BENCH_YEARS_ARCHIVE_PACE") or "0.25"
    command = [sys.executable, "manage.py", "archive", "--tenant", TENANT, "--pace", pace] + (
        ["--limit", limit] if limit else [])
    actions_before = Action.objects.filter(tenant=tenant).count()
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    during = []
    while child.poll() is None or len(during) < 5:
        during.append(timed(baseline_n + len(during)))
    out, err = child.communicate()
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        return {"error": f"manage.py archive exited {child.returncode}: {err[-500:]}"}
    said = re.search(r"ok: archived (\d+) run\(s\), (\d+) action\(s\)", out)
    runs, archived = (int(said.group(1)), int(said.group(2))) if said else (0, 0)
    rested = re.search(r"resting ([\d.]+) of", out)
    working = seconds - (float(rested.group(1)) if rested else 0.0)
    segment_bytes = sum(p.stat().st_size for p in (folder / "segments").rglob("*") if p.is_file())
    hot_actions = Action.objects.filter(tenant=tenant).count()
    result = {
        "runs": runs, "actions": archived, "seconds": round(seconds, 1), "pace": float(pace),
        "actions_per_s": round(archived / seconds) if seconds else None,
        "actions_per_s_working": round(archived / working) if working > 0 else None,
        "archived_bytes_per_action": round(segment_bytes / archived) if archived else None,
        "saga_p50_before_ms": round(summary(before)["p50"], 2), "saga_p50_during_ms": round(summary(during)["p50"], 2),
        "sagas_during": len(during), "actions_hot_before": actions_before, "actions_hot_after": hot_actions,
        "after": sizes(hot_actions + Action.objects.filter(tenant=saga_tenant).count()),
        "command": out.strip().splitlines()[-3:],
    }
    result["saga_during_over_before"] = round(result["saga_p50_during_ms"] / result["saga_p50_before_ms"], 3)
    from django.conf import settings

    settings.UNWIND_ARCHIVE_URL = env["UNWIND_ARCHIVE_URL"]  # this process reads the segments the command wrote
    result["verify_hot_and_archived"] = verify(Tenant.objects.get(pk=tenant.pk))
    return result


def setup():
    """A fresh database with the tenant, its tools, an operator and one real saga to clone."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from bench.engine import Saga, tenant_with_tools
    from ledger.tenancy import membership_set

    call_command("migrate", verbosity=0)
    tenant, agent, _ = tenant_with_tools(TENANT)
    status = Saga(tenant, agent).onboard(0, False)
    assert status == "completed", status
    user = get_user_model().objects.create_user("years-operator", "operator@years.invalid", None)
    membership_set(tenant=tenant, user=user, role="operator")
    return tenant, user


def child(n: int, months: int, requests: int) -> dict:
    from django.db import connection

    from ledger.models import Action, Run

    tenant, user = setup()
    loaded = load(tenant, n, months=months)
    actions = Action.objects.filter(tenant=tenant).count()
    log(f"years: {loaded}")
    out = {"n": n, "months": months, "postgresql": connection.pg_version, "load": loaded, **sizes(actions)}
    log(f"years: {out['bytes_per_action']} bytes per action hot")
    recent = Run.objects.filter(tenant=tenant).order_by("-created_at").values_list("pk", flat=True)[1]
    oldest = Run.objects.filter(tenant=tenant).order_by("created_at").values_list("pk", flat=True).first()
    out["pages"] = pages(user, {"recent": recent, "oldest": oldest}, requests)
    log(f"years: pages {out['pages']}")
    out["verify"] = verify(tenant)
    log(f"years: verify {out['verify']}")
    out["archive"] = archive_part(tenant, months)
    log(f"years: archive {out['archive']}")
    return out


def copy_of(migrated: str) -> None:
    """Make this part's database a copy of a freshly migrated one (`make bench` does, after its migrate): a
    migrate of its own would cost a smoke run most of its time."""
    import psycopg

    from bench.common import psycopg_url

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{YEARS_DB}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{YEARS_DB}" TEMPLATE "{migrated}"')


def measure(*, fresh: bool = True) -> dict:
    """Run this part in a child process on its own database (the parent's connection is to BENCH_DB): a new one,
    or (`fresh=False`) the copy `copy_of` made."""
    from bench.common import recreate_database

    if fresh:
        recreate_database(YEARS_DB)
    env = dict(os.environ, BENCH_DB=YEARS_DB, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "bench.years", "--child"], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout)


def main() -> None:
    from bench.common import django_setup, recreate_database

    if "--child" not in sys.argv:
        recreate_database(YEARS_DB)
        os.environ["BENCH_DB"] = YEARS_DB
        os.execv(sys.executable, [sys.executable, "-m", "bench.years", "--child"])
    django_setup()
    print(json.dumps(child(**settings_from_env()), indent=1))


if __name__ == "__main__":
    main()
