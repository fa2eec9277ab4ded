"""Issue 42: the audit chain's hashes are stored as their 32 bytes on PostgreSQL (ledger/models.py HexDigestField,
migration 0032), and are hex text everywhere else.

What must hold: a chain written before the migration (hex text) still verifies after it, every hash the same; a hash
that is not hex stops the migration with a sentence instead of being stored as something else; going back gives the
same text; the chain keeps verifying as new events are appended; and the field never lets text that is not a digest
reach the column.
"""
from __future__ import annotations

import pytest
from django.db import connection

from ledger.audit.verify import verify_chain
from ledger.models import AuditEvent, HexDigestField
from tests.conftest import needs_postgres
from tests.helpers import act, in_scratch_database, open_run

_CONVERT = """
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from bench import years
from bench.engine import Saga, tenant_with_tools
from ledger.audit.verify import verify_chain

def column():
    with connection.cursor() as cursor:
        cursor.execute("SELECT data_type FROM information_schema.columns WHERE table_name = 'ledger_auditevent'"
                       " AND column_name = 'hash'")
        return cursor.fetchone()[0]

def hashes():
    with connection.cursor() as cursor:
        cast = "encode(%s, 'hex')" if column() == "bytea" else "%s"
        cursor.execute(f"SELECT seq, {cast % 'prev_hash'}, {cast % 'hash'} FROM ledger_auditevent WHERE tenant_id = %s"
                       " ORDER BY seq", [tenant.pk])
        return [list(row) for row in cursor.fetchall()]

call_command("migrate", verbosity=0)
tenant, agent, _ = tenant_with_tools("bytes")
Saga(tenant, agent).onboard(0, False)  # the saga the bulk load clones
written = hashes()
call_command("migrate", "ledger", "0031", verbosity=0)  # back: the hashes as hex text again
out = {"back": column(), "back_same": hashes() == written}
years.load(tenant, 300, months=3)  # a chain written as the code before 0032 wrote it (hex text)
out["old_verify"] = verify_chain(tenant.pk).ok
old = hashes()
with connection.cursor() as cursor:  # a hash edited behind the services' back, not hex
    cursor.execute("UPDATE ledger_auditevent SET hash = 'not a digest' WHERE tenant_id = %s AND seq = 3", [tenant.pk])
try:
    call_command("migrate", verbosity=0)
    out["refused"] = ""
except RuntimeError as refused:
    out["refused"] = str(refused)
out["after_refusal"] = column()
with connection.cursor() as cursor:
    cursor.execute("UPDATE ledger_auditevent SET hash = %s WHERE tenant_id = %s AND seq = 3", [old[2][2], tenant.pk])
call_command("migrate", verbosity=0)
out.update(column=column(), same=hashes() == old, events=len(old), verify=verify_chain(tenant.pk).ok)
Saga(tenant, agent).onboard(1, False)
out["appended_verify"] = verify_chain(tenant.pk).ok
out["appended"] = len(hashes()) - len(old)
print(json.dumps(out))
"""


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_a_chain_written_as_text_verifies_after_the_migration():
    found = in_scratch_database(_CONVERT, "bytes")
    assert found["back"] == "character varying" and found["back_same"], found
    assert found["old_verify"] and found["events"] > 300, found
    assert "audit event #3 of tenant" in found["refused"] and "verify_audit" in found["refused"], found
    assert found["after_refusal"] == "character varying", found  # the refused migration changed nothing
    assert found["column"] == "bytea" and found["same"] and found["verify"], found
    assert found["appended"] > 0 and found["appended_verify"], found


def test_the_hashes_read_back_as_hex_and_an_edited_one_is_named(tools):
    """Whatever the column holds, the models and the walk read 64 hex digits, and an edit of one still fails the
    chain (stored as bytes, a hash is compared as the hex it was made as)."""
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "h@x.io", "name": "H"})
    event = AuditEvent.objects.filter(tenant_id=run.tenant_id).order_by("-seq").first()
    assert len(event.hash) == 64 and int(event.hash, 16) >= 0 and len(event.prev_hash) == 64
    assert verify_chain(run.tenant_id).ok
    changed = format(int(event.hash, 16) ^ 1, "064x")
    AuditEvent.objects.filter(pk=event.pk).update(hash=changed)
    assert AuditEvent.objects.get(pk=event.pk).hash == changed
    report = verify_chain(run.tenant_id)
    assert not report.ok and report.check == "hmac" and f"#{event.seq}" in report.problem, report


def test_text_that_is_not_a_digest_never_reaches_a_postgresql_column():
    field = AuditEvent._meta.get_field("hash")
    assert isinstance(field, HexDigestField)
    if connection.vendor == "postgresql":
        assert field.get_db_prep_value("ab" * 32, connection) == bytes.fromhex("ab" * 32)
        with pytest.raises(ValueError):
            field.get_db_prep_value("not a digest", connection)
    else:
        assert field.get_db_prep_value("ab" * 32, connection) == "ab" * 32
    assert field.from_db_value(memoryview(b"\x01" * 32), None, connection) == "01" * 32
