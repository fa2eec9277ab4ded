"""Retention enforced, archives that verify, legal holds (docs/archive.md): settled runs past their retention leave
the hot tables for signed, content-addressed segments, and `verify_audit` checks hot and archived as one chain,
naming a segment that was changed, removed or reordered."""
import io
import os
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from ledger.archive import segments
from ledger.archive.service import archive_tenant, legal_hold_set
from ledger.archive.store import segment_key
from ledger.audit.verify import verify_chain
from ledger.errors import ValidationFailed
from ledger.models import (
    Action, ArchivedRun, ArchiveSegment, Attempt, AuditEvent, Checkpoint, Run, RunStatus, Tenant,
)
from ledger.policy.versions import tenant_defaults_set
from recovery.models import RecoveryItem
from tests.helpers import act, fault, open_run
from ledger.engine.runs import run_complete

DAY = 86400


@pytest.fixture
def signing(settings, tmp_path):
    key_file = tmp_path / "keys" / "audit-signing.pem"
    call_command("audit_keygen", str(key_file), stdout=io.StringIO(), stderr=io.StringIO())
    settings.UNWIND_AUDIT_SIGNING_KEY_FILE = str(key_file)
    settings.UNWIND_AUDIT_PUBLIC_KEY_FILE = str(key_file) + ".pub"
    settings.UNWIND_ARCHIVE_URL = f"file://{tmp_path / 'archive'}"
    return tmp_path / "archive"


def completed_run(world, goal="onboard"):
    run = open_run(world, goal=goal)
    user = act(run, "hr.create_user", {"email": f"{goal}@x.io", "name": goal})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    return run_complete(run=run, actor="agent:booker")


def compensated_run(world):
    run = open_run(world, goal="undone")
    act(run, "hr.create_user", {"email": "u@x.io", "name": "U"})
    fault("email.send", "status", status=400)
    act(run, "email.send", {"to": "u@x.io", "subject": "S", "body": "b"})
    run.refresh_from_db()
    assert run.status == RunStatus.COMPENSATED
    return run


def stuck_run(world):
    """A run in the recovery queue: its item is open."""
    run = open_run(world, goal="stuck")
    act(run, "hr.create_user", {"email": "s@x.io", "name": "S"})
    fault("hr.delete_user", "status", status=400)
    fault("email.send", "status", status=400)
    act(run, "email.send", {"to": "s@x.io", "subject": "S", "body": "b"})
    run.refresh_from_db()
    assert RecoveryItem.objects.filter(run=run, status="open").exists()
    return run


def age(*runs, days=100):
    """Move runs back in time (when they were opened and finished): what waiting out a retention looks like."""
    past = timezone.now() - timedelta(days=days)
    Run.objects.filter(pk__in=[r.pk for r in runs]).update(created_at=past, finished_at=past)


def retain(world, days=90):
    tenant_defaults_set(tenant=world.acme, values={"retention_seconds": days * DAY}, actor="test")
    world.acme.refresh_from_db()


def archive(world, **kwargs):
    return archive_tenant(tenant=Tenant.objects.get(pk=world.acme.pk), actor="test", **kwargs)


def hot(run) -> bool:
    return Run.objects.filter(pk=run.pk).exists()


@pytest.fixture
def archived(tools, signing):
    """acme with two settled runs past a 90-day retention archived, one recent run and one stuck run kept hot."""
    old_done, old_undone = completed_run(tools, "old"), compensated_run(tools)
    recent = completed_run(tools, "recent")
    stuck = stuck_run(tools)
    age(old_done, old_undone, stuck)
    retain(tools)
    report = archive(tools)
    assert report.runs == 2 and len(report.segments) == 1, report
    tools.old_done, tools.old_undone, tools.recent, tools.stuck = old_done, old_undone, recent, stuck
    tools.archive_dir = signing
    return tools


def test_settled_runs_past_retention_leave_the_hot_tables_for_a_segment(archived):
    assert not hot(archived.old_done) and not hot(archived.old_undone)
    assert hot(archived.recent) and hot(archived.stuck)
    ids = [archived.old_done.pk, archived.old_undone.pk]
    assert not Action.objects.filter(run_id__in=ids).exists()
    assert not Attempt.objects.filter(action__run_id__in=ids).exists()
    assert not Checkpoint.objects.filter(run_id__in=ids).exists()
    assert not AuditEvent.objects.filter(run_ref__in=ids).exists()
    segment = ArchiveSegment.objects.get(tenant=archived.acme)
    data = (archived.archive_dir / segment_key(archived.acme.pk, segment.sha256)).read_bytes()
    read = segments.decode(data)
    assert read.manifest["runs"] == sorted(ids, key=lambda pk: ArchivedRun.objects.get(pk=pk).last_seq)
    assert {row["id"] for row in read.rows["ledger.run"]} == set(ids)
    assert read.manifest["head"]["seq"] == segment.last_seq == read.events[-1]["seq"]
    assert read.manifest["prev_hash"] == "0" * 64 and read.events[0]["seq"] == 1
    assert set(ArchivedRun.objects.values_list("run_id", flat=True)) == set(ids)
    # The stuck run's events inside the slice stay hot beside their archived copies, and the chain verifies whole.
    report = verify_chain(archived.acme.pk)
    assert report.ok, report
    assert AuditEvent.objects.filter(kind="archive.segment", tenant=archived.acme).count() == 1


def test_a_second_pass_continues_the_chain(archived):
    age(archived.recent)
    report = archive(archived)
    assert report.runs == 1
    first, second = ArchiveSegment.objects.filter(tenant=archived.acme).order_by("number")
    assert second.first_seq == first.last_seq + 1
    assert verify_chain(archived.acme.pk).ok, verify_chain(archived.acme.pk)


def test_unsettled_open_and_held_runs_are_never_archived(tools, signing):
    stuck = stuck_run(tools)
    held = completed_run(tools, "held")
    running = open_run(tools, goal="still going")
    act(running, "hr.create_user", {"email": "r@x.io", "name": "R"})
    legal_hold_set(tenant=tools.acme, run=held, held=True, actor="user:ada", why="litigation 2026-17")
    age(stuck, held, running)
    retain(tools)
    assert archive(tools).runs == 0
    assert hot(stuck) and hot(held) and hot(running)
    # The hold was recorded with who and why; clearing it lets the run go.
    event = AuditEvent.objects.get(kind="legal_hold.set", run_ref=held.pk)
    assert event.actor == "user:ada" and event.data["why"] == "litigation 2026-17" and event.data["held"] is True
    legal_hold_set(tenant=tools.acme, run=held, held=False, actor="user:ada", why="case closed")
    assert archive(tools).runs == 1 and not hot(held)
    assert verify_chain(tools.acme.pk).ok


def test_a_tenant_under_legal_hold_archives_nothing(tools, signing):
    old = completed_run(tools, "old")
    age(old)
    retain(tools)
    legal_hold_set(tenant=tools.acme, held=True, actor="user:ada", why="regulator's request")
    report = archive(tools)
    assert report.runs == 0 and report.kept == "under a legal hold" and hot(old)
    with pytest.raises(ValidationFailed):
        legal_hold_set(tenant=tools.acme, held=False, actor="user:ada", why="  ")
    assert Tenant.objects.get(pk=tools.acme.pk).legal_hold


def test_runs_within_retention_and_tenants_without_one_stay(tools, signing):
    young = completed_run(tools, "young")
    age(young, days=30)
    assert archive(tools).kept.startswith("its retention is forever")
    retain(tools, days=90)
    assert archive(tools).runs == 0 and hot(young)


def test_the_longest_retention_of_a_tool_the_run_used_wins(tools, signing):
    from ledger.policy.versions import tool_upsert
    from ledger.api.tools import policy_of

    spec = policy_of(tools.acme.tools.get(name="licenses.provision", is_current=True))
    tool_upsert(tenant=tools.acme, name="licenses.provision", spec={**spec, "retention": "365d"}, actor="test")
    kept_long = completed_run(tools, "licensed")
    other = open_run(tools, goal="no license")
    act(other, "hr.create_user", {"email": "n@x.io", "name": "N"})
    run_complete(run=other, actor="agent:booker")
    age(kept_long, other, days=100)
    retain(tools, days=90)
    assert archive(tools).runs == 1
    assert hot(kept_long) and not hot(other)
