"""Shared fixtures: two tenants with fixed personas, and the sandbox world's tools.

Personas (healthchecks-style): in tenant "acme" alice approves, oscar operates, victor only views, ada
administers (tools and policy); ben is a second approver for quorum tests; mallory belongs to tenant
"globex" only and is used for every isolation check.
"""
import copy
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import TransactionTestCase

from ledger.tenancy import agent_create, membership_set, tenant_create
from ledger.policy.versions import tools_load

ROOT = Path(__file__).resolve().parent.parent
POLICY = yaml.safe_load((ROOT / "sandbox" / "policy.yaml").read_text())

READERS = {
    "/sandbox/hr/users/": "sandbox.read_user",
    "/sandbox/crm/tickets/": "sandbox.read_ticket",
    "/sandbox/payments/charges/": "sandbox.read_charge",
    "/sandbox/email/messages?idempotency_key=": "sandbox.messages_with_key",
}


def in_process_policy() -> dict:
    """The sandbox policy with every HTTP tool switched to its in-process callable (no server needed): the
    registry keys the sandbox registers (sandbox/callables.py), as a deployer's policy names them."""
    policy = copy.deepcopy(POLICY)
    for name, spec in policy["tools"].items():
        spec["executor"] = {"kind": "python", "path": "sandbox." + name}
        for part in ("snapshot", "lookup"):
            read = spec.get(part, {}).get("read")
            if read:
                spec[part]["read"] = next(v for k, v in READERS.items() if read.startswith(k))
    return policy


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


needs_postgres = pytest.mark.skipif(
    not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"),
    reason="needs PostgreSQL for real row locks and concurrent writers (run with DATABASE_URL=postgres://…)",
)


# The modules whose tests tell the engine's two paths apart on PostgreSQL (its functions, the default, against
# UNWIND_FAST_PATH=0): the engine's and the guarantees' own, the lifecycle model, and every module with tests that
# need PostgreSQL but those of PATH_FREE_MODULES. Their tests are marked `engine_paths`. The SQLite run already runs
# every test on the Python path, so CI's third run (PostgreSQL on the Python path, .ci/run) takes only these
# (`-m engine_paths`).
ENGINE_PATH_MODULES = {
    "test_args_as_sent", "test_busy_tenant", "test_chaos_short", "test_clock_skew", "test_database_unavailable",
    "test_fastpath", "test_g01_exactly_once", "test_g02_no_silent_partial", "test_g03_lifo_unwind",
    "test_g04_ordering_law", "test_g05_crash_safety", "test_g06_approvals", "test_g07_no_blind_overwrite",
    "test_g08_tenant_isolation", "test_g09_audit_chain", "test_g10_cancellation", "test_holds", "test_holds_api",
    "test_inline_twin", "test_insider_audit", "test_insider_edits", "test_leases_at_write", "test_lifecycle_model",
    "test_limit_totals", "test_mcp_servers", "test_one_decision", "test_one_effect", "test_parity",
    "test_partitions_engine", "test_retry_patience", "test_rules_one_call", "test_rules_properties",
    "test_saga_moves_http", "test_settling", "test_sql_holds_no_rules", "test_tracing", "test_undo_plan_http",
    "test_wire_json_results",
}
# Modules with tests that need PostgreSQL whose subject the engine's path does not touch: what they check is the same
# code on either path, so the Python-path run leaves them out (5.5 of its 25 minutes in CI) and the PostgreSQL run
# has them. None may switch the path (tests/test_engine_paths_marked.py).
PATH_FREE_MODULES = {
    "test_audit_hash_bytes",  # migration 0032's conversion of the chain's hashes, both ways
    "test_engine_functions",  # the installer of the engine's functions and the guard of their text
    "test_partitions",  # creating and detaching months of the partitioned tables
    "test_production_server",  # the ASGI/WSGI servers under slow clients and many waits
    "test_waits",  # waiting on a step's outcome off the event loop, and the slots' bound
}


# Modules whose tests that ask for no database reach none by another way either: no process they start is given this
# run's DATABASE_URL (each is given a SQLite file of its own, or no database at all), and no skip of theirs depends on
# the database. Such a test (no `db`, `transactional_db` or `live_server`, no django_db mark, no skip mark;
# pytest-django refuses it the database in-process) gives the same answer on SQLite and PostgreSQL, and is marked
# `database_free`: CI's PostgreSQL run leaves these out (`-m "not database_free"`, .ci/run), the SQLite run has them.
# A module that starts a process on the inherited DATABASE_URL, or skips by the database inside a test, stays off.
DATABASE_FREE_MODULES = {
    "test_adapter_openai_agents", "test_api_auth", "test_api_health", "test_api_out_plan", "test_archive_memory",
    "test_audit_keyed", "test_canonical", "test_client", "test_console_queue", "test_demo_command", "test_doc_links",
    "test_engine_paths_marked", "test_fair_share", "test_layers", "test_mailbox_spelling", "test_mcp_proxy",
    "test_money_rows", "test_newcomer_details", "test_pages", "test_production_settings", "test_readme_short",
    "test_rules_policy", "test_sandbox_access", "test_self_approval_spelling", "test_settings_env", "test_signing",
    "test_slack", "test_static", "test_trust_code_and_urls",
}
DATABASE_FIXTURES = {"db", "transactional_db", "live_server", "django_db_reset_sequences",
                     "django_db_serialized_rollback"}


def database_free(item) -> bool:
    """A test of DATABASE_FREE_MODULES that asks for no database and has no skip mark."""
    return (item.module.__name__.rsplit(".", 1)[-1] in DATABASE_FREE_MODULES
            and not DATABASE_FIXTURES & set(item.fixturenames) and item.get_closest_marker("django_db") is None
            and item.get_closest_marker("skip") is None and item.get_closest_marker("skipif") is None)


# The two tables post_migrate fills (contenttypes' and auth's receivers), and what they held when it last had: a test
# that left them so needs neither their DELETE nor those receivers, which cost 0.1 s of CPU and a few dozen queries
# a transactional test (0.3 s of its teardown on a loaded machine). Keyed by database alias.
POST_MIGRATE_TABLES = ("django_content_type", "auth_permission")
_post_migrate_left: dict[str, str] = {}


def _post_migrate_tables_hash(cursor) -> str:
    """The md5 of every row of POST_MIGRATE_TABLES: any row a test added, changed or deleted changes it."""
    digest = hashlib.md5()
    for table in POST_MIGRATE_TABLES:
        cursor.execute(f"SELECT * FROM {table} ORDER BY id")
        digest.update(repr(cursor.fetchall()).encode())
    return digest.hexdigest()


def _emit_post_migrate(db_name: str, *, without_tables_receivers: bool) -> None:
    """post_migrate as `flush` sends it, or without the receivers that fill POST_MIGRATE_TABLES when those hold what
    they last made (every other receiver, as the ledger's that reinstalls a function a test replaced, still runs)."""
    from django.contrib.auth.management import create_permissions
    from django.contrib.contenttypes.management import create_contenttypes
    from django.core.management.sql import emit_post_migrate_signal
    from django.db.models.signals import post_migrate

    if not without_tables_receivers:
        emit_post_migrate_signal(verbosity=0, interactive=False, db=db_name)
        return
    post_migrate.disconnect(create_permissions, dispatch_uid="django.contrib.auth.management.create_permissions")
    post_migrate.disconnect(create_contenttypes)
    try:
        emit_post_migrate_signal(verbosity=0, interactive=False, db=db_name)
    finally:
        post_migrate.connect(create_permissions, dispatch_uid="django.contrib.auth.management.create_permissions")
        post_migrate.connect(create_contenttypes)


def _delete_what_a_test_wrote(self) -> None:
    """A transactional test's teardown: DELETE every table's rows in one transaction, then post_migrate, as Django's
    `flush` does, but on PostgreSQL where `flush` would TRUNCATE them. TRUNCATE makes new files for every table,
    partition and index (60 tables with the monthly partitions): 0.2 s a test on a quiet machine, most of a second on
    a loaded one. A test writes a few rows, which DELETE removes in a few milliseconds. There the transaction runs with
    the session's triggers off (`session_replication_role = replica`, a superuser's, as CI's `postgres` is; anyone else
    gets Django's flush): no foreign key is checked while every table empties, and the limit totals' trigger on a
    deleted step (migration 0029) does not write totals back for a measure deleted in the same breath. On both, the
    content types and permissions are kept when they hold, to the byte, what post_migrate last made of them
    (POST_MIGRATE_TABLES): post_migrate would make them again the same, only under new ids."""
    from django.core.management.color import no_style
    from django.db import connections, transaction

    for db_name in self._databases_names(include_mirrors=False):
        conn = connections[db_name]
        if (conn.vendor not in ("postgresql", "sqlite") or self.available_apps is not None or self.serialized_rollback
                or self.reset_sequences):
            _django_fixture_teardown(self)
            continue
        if conn.vendor == "postgresql":
            with conn.cursor() as cursor:
                cursor.execute("SHOW is_superuser")
                superuser = cursor.fetchone()[0] == "on"
            if not superuser:
                _django_fixture_teardown(self)
                continue
        tables = conn.introspection.django_table_names(only_existing=True, include_views=False)
        with transaction.atomic(using=db_name), conn.cursor() as cursor:
            as_left = _post_migrate_tables_hash(cursor) == _post_migrate_left.get(db_name)
            if as_left:
                tables = [table for table in tables if table not in POST_MIGRATE_TABLES]
            if conn.vendor == "postgresql":
                cursor.execute("SET LOCAL session_replication_role = replica")
                cursor.execute("; ".join(f"DELETE FROM {conn.ops.quote_name(table)}" for table in tables))
            else:  # `flush`'s own statements; SQLite checks the (deferred) foreign keys at the commit
                conn.ops.execute_sql_flush(conn.ops.sql_flush(no_style(), tables))
        _emit_post_migrate(db_name, without_tables_receivers=as_left)
        if not as_left:
            with conn.cursor() as cursor:
                _post_migrate_left[db_name] = _post_migrate_tables_hash(cursor)


_django_fixture_teardown = TransactionTestCase._fixture_teardown
TransactionTestCase._fixture_teardown = _delete_what_a_test_wrote


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="Run the K-th of N shards of the test modules (whole modules, dealt in turn by name): CI "
                          "runs the PostgreSQL suite as two shards side by side (.ci/run).")


def shard_of(config) -> tuple[int, int] | None:
    """(K, N) from --shard K/N, 1 <= K <= N; None without it."""
    value = config.getoption("shard")
    if value is None:
        return None
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--shard {value}: expected K/N with 1 <= K <= N, e.g. --shard 1/2")
    return int(k), int(n)


# Modules that start `manage.py demo` in this clone, which writes var/demo.env (and the demo's key and logs) there:
# side by side in two shards, one's second shell could read the other's address and key. They share the last shard.
DEMO_FILES_MODULES = {"test_demo_beside", "test_demo_twice", "test_runnable_docs"}


def deal_shard(config, items) -> None:
    """Keep the items of this shard's modules: the modules sorted by path and dealt in turn, so a module's tests (and
    its module-scoped fixtures, such as a live server) stay in one process; DEMO_FILES_MODULES all in the last."""
    shard = shard_of(config)
    if shard is None:
        return
    k, n = shard
    demo = {f"tests/{name}.py" for name in DEMO_FILES_MODULES}
    modules = sorted({item.nodeid.split("::", 1)[0] for item in items} - demo)
    mine = {module for index, module in enumerate(modules) if index % n == k - 1} | (demo if k == n else set())
    kept = [item for item in items if item.nodeid.split("::", 1)[0] in mine]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid.split("::", 1)[0] not in mine])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    deal_shard(config, items)
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in ENGINE_PATH_MODULES:
            item.add_marker(pytest.mark.engine_paths)
        if item.module is not None and database_free(item):
            item.add_marker(pytest.mark.database_free)


class World:
    def __init__(self):
        User = get_user_model()
        self.acme = tenant_create(slug="acme", name="Acme")
        self.globex = tenant_create(slug="globex", name="Globex")
        self.users = {}
        for username, tenant, role in [
            ("alice", self.acme, "approver"), ("ben", self.acme, "approver"), ("oscar", self.acme, "operator"),
            ("victor", self.acme, "viewer"), ("ada", self.acme, "admin"), ("mallory", self.globex, "admin"),
        ]:
            user = User.objects.create_user(username, f"{username}@example.com", "pw-" + username)
            membership_set(tenant=tenant, user=user, role=role)
            self.users[username] = user
        self.agent, self.key = agent_create(tenant=self.acme, name="booker")
        self.other_agent, self.other_key = agent_create(tenant=self.globex, name="intruder")

    def __getattr__(self, name):
        users = self.__dict__.get("users", {})
        if name in users:
            return users[name]
        raise AttributeError(name)


def seed_sandboxes(world: "World") -> None:
    """Each tenant's sandbox world starts with its seed tickets."""
    from sandbox.services import sandbox_reset

    for tenant in (world.acme, world.globex):
        sandbox_reset(tenant=tenant)


@pytest.fixture
def world(db, _engine_settings):
    world = World()
    seed_sandboxes(world)
    return world


_SCHEMAS_FOUND_VALID: set[str] = set()


@contextmanager
def schemas_checked_once():
    """Inside: an argument schema the JSON Schema check (ledger.policy.schemas.check) found valid once in this process
    is not checked again. The same schema gets the same answer; the check is 43 of the 47 ms of CPU a load of the
    sandbox policy takes, twice a test for the `tools` fixture. Only the fixtures load inside; the tests of the check
    call tools_load themselves."""
    from ledger.policy import schemas

    check = schemas.check

    def check_once(schema, *, where):
        key = json.dumps(schema, sort_keys=True)
        if key not in _SCHEMAS_FOUND_VALID:
            check(schema, where=where)
            _SCHEMAS_FOUND_VALID.add(key)

    schemas.check = check_once
    try:
        yield
    finally:
        schemas.check = check


@pytest.fixture
def tools(world):
    """The sandbox tools, executed in-process, loaded into acme and globex."""
    with schemas_checked_once():
        for tenant in (world.acme, world.globex):
            tools_load(tenant=tenant, document=in_process_policy(), actor="test")
    world.acme.refresh_from_db()
    return world


@pytest.fixture
def http_tools(transactional_db, live_server, settings, _engine_settings):
    """The sandbox tools over real HTTP against a live server (the product's own policy file)."""
    settings.UNWIND_TOOL_BASE_URL = live_server.url
    world = World()
    seed_sandboxes(world)
    with schemas_checked_once():
        tools_load(tenant=world.acme, document=POLICY, actor="test")
    world.live_server = live_server
    return world


@pytest.fixture(autouse=True)
def _engine_settings(settings):
    settings.UNWIND_MAX_BACKOFF = 0.05
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
