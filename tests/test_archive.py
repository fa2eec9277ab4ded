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
from ledger.archive.store import DirectoryStore, segment_key
from ledger.audit.verify import verify_chain
from ledger.errors import ArchiveUnavailable, ValidationFailed
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



def test_the_index_rows_say_what_each_archived_run_was(tools, signing):
    """ArchivedRun and ArchivedKey (written in one statement each on PostgreSQL) hold each run's agent, finished_at,
    event span and segment, and a key for each of its steps, whatever order the runs were taken in."""
    from ledger.models import ArchivedKey

    runs = [completed_run(tools, "first"), compensated_run(tools), completed_run(tools, "third")]
    age(*runs)
    Run.objects.filter(pk=runs[1].pk).update(finished_at=timezone.now() - timedelta(days=120, microseconds=7))
    retain(tools)
    expected = {}
    for run in Run.objects.filter(pk__in=[r.pk for r in runs]):
        seqs = list(AuditEvent.objects.filter(run_ref=run.pk).values_list("seq", flat=True))
        steps = sorted(str(pk) for pk in Action.objects.filter(run_id=run.pk).values_list("pk", flat=True))
        expected[run.pk] = (run.agent_id, run.finished_at, min(seqs), max(seqs), steps)
    now = timezone.now()
    report = archive(tools, now=now, segment_runs=2)
    assert report.runs == 3 and len(report.segments) == 2, report
    segments_by_sha = {s.sha256: s.pk for s in ArchiveSegment.objects.all()}
    for pk, (agent, finished, first, last, steps) in expected.items():
        index = ArchivedRun.objects.get(pk=pk)
        assert (index.tenant_id, index.agent_id, index.finished_at, index.first_seq, index.last_seq) == (
            tools.acme.pk, agent, finished, first, last)
        assert index.archived_at == now and index.segment_id in segments_by_sha.values()
        assert sorted(ArchivedKey.objects.filter(run_id=pk, label="ledger.action").values_list(
            "value", flat=True)) == steps
    assert ArchivedKey.objects.filter(label="ledger.action").count() == sum(len(e[4]) for e in expected.values())

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


# --- tampering with the archive ---------------------------------------------------------------------------------

def segment_files(world):
    return [world.archive_dir / segment_key(world.acme.pk, s.sha256)
            for s in ArchiveSegment.objects.filter(tenant=world.acme).order_by("number")]


def broken(world, check="archive") -> str:
    report = verify_chain(world.acme.pk)
    assert not report.ok, "the tampering went unnoticed"
    assert report.check == check, report
    return report.problem


@pytest.fixture
def two_segments(archived):
    age(archived.recent)
    assert archive(archived).runs == 1
    assert verify_chain(archived.acme.pk).ok
    return archived


def test_a_changed_byte_names_the_segment(two_segments):
    path = segment_files(two_segments)[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert "segment 1 (" in (problem := broken(two_segments)) and "was changed" in problem


def test_a_segment_rewritten_whole_under_its_old_name_is_named(two_segments):
    """An insider who decodes a segment, edits an event and compresses it again cannot keep its name."""
    path = segment_files(two_segments)[1]
    read = segments.decode(path.read_bytes())
    read.events[0]["actor"] = "someone else"
    data, _ = segments.encode({k: v for k, v in read.manifest.items() if k not in ("t", "format")}, [
        {"seq": e["seq"], "kind": e["kind"], "actor": e["actor"], "run_ref": e["run"], "action_ref": e["action"],
         "data": e["data"], "created_at": timezone.datetime.fromisoformat(e["at"]), "prev_hash": e["prev"],
         "hash": e["hash"], "key_id": e["key"]} for e in read.events], [])
    path.write_bytes(data)
    assert "segment 2 (" in (problem := broken(two_segments)) and "was changed" in problem


def test_a_removed_segment_is_named(two_segments):
    os.remove(segment_files(two_segments)[0])
    assert "segment 1 (" in (problem := broken(two_segments)) and "missing" in problem and "removed" in problem


def test_swapped_segments_are_named(two_segments):
    first, second = segment_files(two_segments)
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    problem = broken(two_segments)
    assert "segment 1 (" in problem and "holds the bytes of segment 2" in problem and "swapped" in problem


def test_segments_renumbered_in_the_index_are_named(two_segments):
    """Reordering the index (the database's list of segments) shows as a segment that does not follow."""
    first, second = ArchiveSegment.objects.filter(tenant=two_segments.acme).order_by("number")
    ArchiveSegment.objects.filter(pk=first.pk).update(number=99)
    ArchiveSegment.objects.filter(pk=second.pk).update(number=1)
    ArchiveSegment.objects.filter(pk=first.pk).update(number=2)
    assert "does not follow" in broken(two_segments)


def test_an_index_row_removed_is_named(two_segments):
    last = ArchiveSegment.objects.filter(tenant=two_segments.acme).order_by("number").last()
    ArchivedRun.objects.filter(segment=last).delete()
    last.delete()
    problem = verify_chain(two_segments.acme.pk)
    assert not problem.ok and "#" in problem.problem, problem


def test_a_hot_row_deleted_without_archiving_is_still_reported(archived):
    Action.objects.filter(run=archived.recent).order_by("pk").last().delete()
    assert "is in the audit chain but not in the ledger: deleted" in broken(archived, "fingerprint")


def test_an_archived_run_deleted_from_the_hot_tables_by_hand_is_not_archived(archived):
    """Only what a segment holds left legitimately: a run deleted by hand beside an archive is still reported."""
    AuditEvent.objects.filter(run_ref=archived.recent.pk).delete()
    Run.objects.filter(pk=archived.recent.pk).delete()
    assert not verify_chain(archived.acme.pk).ok


# --- the command ----------------------------------------------------------------------------------------------

def test_the_command_archives_and_its_dry_run_changes_nothing(tools, signing):
    old = completed_run(tools, "old")
    age(old)
    retain(tools)
    out = io.StringIO()
    call_command("archive", "--dry-run", stdout=out)
    assert f"tenant acme: would archive 1 run(s), 2 action(s): {old.pk}" in out.getvalue()
    assert hot(old) and not ArchiveSegment.objects.exists()
    out = io.StringIO()
    call_command("archive", stdout=out)
    assert "tenant acme: archived 1 run(s), 2 action(s) in 1 segment(s)" in out.getvalue()
    assert "tenant globex: nothing archived: its retention is forever" in out.getvalue()
    assert not hot(old)
    out = io.StringIO()
    call_command("verify_audit", stdout=out)
    assert out.getvalue().startswith("ok:") and "; 1 archived segment(s) read as part of their chains" in out.getvalue()
    os.remove(signing / segment_key(tools.acme.pk, ArchiveSegment.objects.get().sha256))
    with pytest.raises(CommandError, match=r"tenant acme: broken at segment 1 \(.*missing.*\[check: archive\]"):
        call_command("verify_audit", stdout=io.StringIO())


def test_the_command_explains_a_missing_archive_url(tools, settings):
    settings.UNWIND_ARCHIVE_URL = ""
    with pytest.raises(CommandError, match="UNWIND_ARCHIVE_URL is not set"):
        call_command("archive", stdout=io.StringIO())
    settings.UNWIND_ARCHIVE_URL = "ftp://example.com/x"
    with pytest.raises(CommandError, match="neither file:///path nor s3://"):
        call_command("archive", stdout=io.StringIO())


def test_the_command_explains_a_missing_signing_key(tools, settings, tmp_path):
    settings.UNWIND_ARCHIVE_URL = f"file://{tmp_path}"
    settings.UNWIND_AUDIT_SIGNING_KEY_FILE = ""
    old = completed_run(tools, "old")
    age(old)
    retain(tools)
    with pytest.raises(CommandError, match="UNWIND_AUDIT_SIGNING_KEY_FILE is not set"):
        call_command("archive", stdout=io.StringIO())
    assert hot(old)


def test_retention_in_the_policy_file(tools):
    from ledger.policy.document import parse_document

    doc = parse_document({"agentSafety": {"policies": {}, "audit": {"retention": "90d"}}})
    assert doc.defaults["retention_seconds"] == 90 * DAY
    assert parse_document({"defaults": {"retention": "forever"}}).defaults["retention_seconds"] == 0
    with pytest.raises(ValidationFailed, match="agentSafety.audit.retention"):
        parse_document({"agentSafety": {"audit": {"retention": "10m"}}})
    with pytest.raises(ValidationFailed, match="agentSafety.audit.retention"):
        parse_document({"agentSafety": {"audit": {"retention": "soon"}}})


def test_a_finished_run_with_an_unanswered_customer_request_stays_until_it_is_answered(tools, signing):
    """What another app keeps open for a run (recovery: an unanswered request) keeps it hot, whatever its status."""
    from recovery.requests import customer_request_open, customer_request_reply
    from recovery.trail import trail_link_create

    tenant_defaults_set(tenant=tools.acme, values={"customer_requests_seconds": 7 * DAY}, actor="test")
    run = completed_run(tools, "asked")
    _, token = trail_link_create(run=run, user=tools.oscar)
    asked = customer_request_open(token=token, action_id=None, kind="other", text="my name is misspelt")
    # The request put the run in the queue; the operator closes the item and has not answered the person yet.
    from recovery.services import recovery_close

    recovery_close(item=RecoveryItem.objects.get(run=run, status="open"), user=tools.oscar, reason="fixed the name")
    run.refresh_from_db()
    assert run.status == RunStatus.CLOSED
    age(run)
    retain(tools)
    assert archive(tools).runs == 0 and hot(run)
    customer_request_reply(request=asked, user=tools.oscar, text="fixed, sorry")
    assert archive(tools).runs == 1 and not hot(run)
    assert verify_chain(tools.acme.pk).ok


# --- an S3-compatible bucket -------------------------------------------------------------------------------------

@pytest.fixture
def bucket(settings, monkeypatch, signing):
    """A real S3 API on loopback (moto's server): the archive talks to it over HTTP with boto3, as to any S3."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    settings.UNWIND_ARCHIVE_S3_ENDPOINT_URL = f"http://{host}:{port}"
    settings.UNWIND_ARCHIVE_URL = "s3://unwind-archive/ledger"
    client = boto3.client("s3", endpoint_url=settings.UNWIND_ARCHIVE_S3_ENDPOINT_URL)
    client.create_bucket(Bucket="unwind-archive")
    yield client
    server.stop()


def test_an_s3_bucket_holds_segments_that_verify_and_are_read_back(tools, bucket):
    from ledger.archive.reader import archived_run

    old = completed_run(tools, "old")
    age(old)
    retain(tools)
    assert archive(tools).runs == 1
    segment = ArchiveSegment.objects.get(tenant=tools.acme)
    key = f"ledger/{segment_key(tools.acme.pk, segment.sha256)}"
    stored = bucket.get_object(Bucket="unwind-archive", Key=key)["Body"].read()
    assert segments.decode(stored).manifest["runs"] == [old.pk]
    assert verify_chain(tools.acme.pk).ok
    view = archived_run(tenant_ids=[tools.acme.pk], agent_id=tools.agent.pk, run_id=old.pk)
    assert view.run.goal == "old" and [a.tool.name for a in view.actions] == ["hr.create_user", "licenses.provision"]
    # Read back once, the segment is cached; a rewrite of the object (here one byte) is seen at the next read.
    bucket.put_object(Bucket="unwind-archive", Key=key, Body=stored[:-1] + b"\0")
    with pytest.raises(ArchiveUnavailable, match="no longer hashes to its name"):
        archived_run(tenant_ids=[tools.acme.pk], agent_id=tools.agent.pk, run_id=old.pk)
    bucket.put_object(Bucket="unwind-archive", Key=key, Body=stored)
    assert archived_run(tenant_ids=[tools.acme.pk], agent_id=tools.agent.pk, run_id=old.pk).run.goal == "old"
    bucket.delete_object(Bucket="unwind-archive", Key=key)
    with pytest.raises(ArchiveUnavailable, match="is missing"):
        archived_run(tenant_ids=[tools.acme.pk], agent_id=tools.agent.pk, run_id=old.pk)
    report = verify_chain(tools.acme.pk)
    assert not report.ok and "segment 1 (" in report.problem and "missing from s3://unwind-archive/ledger" in report.problem


def test_a_segment_rewritten_and_reindexed_is_named_by_the_chain(archived):
    """An insider who edits a segment, names it by its new hash and points the index at it is still caught: the chain
    recorded the segment's hash (archive.segment), and that event cannot be rewritten without the audit key."""
    import hashlib

    index = ArchiveSegment.objects.get(tenant=archived.acme)
    path = segment_files(archived)[0]
    read = segments.decode(path.read_bytes())
    manifest = {k: v for k, v in read.manifest.items() if k not in ("t", "format")}
    rows = [(label, row) for label, found in read.rows.items() for row in found]
    rows = [(label, {**row, "goal": "nothing happened"} if label == "ledger.run" else row) for label, row in rows]
    data, sha = segments.encode(manifest, [{"seq": e["seq"], "kind": e["kind"], "actor": e["actor"],
                                            "run_ref": e["run"], "action_ref": e["action"], "data": e["data"],
                                            "created_at": timezone.datetime.fromisoformat(e["at"]),
                                            "prev_hash": e["prev"], "hash": e["hash"], "key_id": e["key"]}
                                           for e in read.events], rows)
    assert sha == hashlib.sha256(data).hexdigest() != index.sha256
    (path.parent / f"{sha}.jsonl.zst").write_bytes(data)
    ArchiveSegment.objects.filter(pk=index.pk).update(sha256=sha)
    problem = broken(archived)
    assert f"recorded segment {index.sha256[:16]}" in problem and "not in the archive index" in problem


def test_a_run_whose_text_holds_line_separators_is_archived_verified_and_read_back(tools, signing):
    """Segments keep text as it is (JSON escapes only "\\n" and the control characters): U+2028, U+2029 and U+0085
    stay inside a line, which ends at "\\n" alone."""
    from ledger.archive.reader import archived_run

    goal = "line\u2028separator\u2029paragraph\x85next line"
    run = open_run(tools, goal=goal)
    act(run, "hr.create_user", {"email": "ls@x.io", "name": "L\u2028S"})
    run = run_complete(run=run, actor="agent:booker")
    age(run)
    retain(tools)
    assert archive(tools).runs == 1
    assert verify_chain(tools.acme.pk).ok
    view = archived_run(tenant_ids=[tools.acme.pk], agent_id=None, run_id=run.pk)
    assert view.run.goal == goal and view.actions[0].args["name"] == "L\u2028S"


def test_a_segment_name_is_never_a_path(tools):
    """Segment names are computed (tenant id, SHA-256), never taken from a request: nothing else can become a path."""
    for hostile in ("../../etc/passwd", "a" * 63, "A" * 64, "", "0" * 64 + "/x", "0" * 64 + "\n"):
        with pytest.raises(ValueError):
            segment_key(tools.acme.pk, hostile)
    assert segment_key("7", "0" * 64) == f"tenant-7/{'0' * 64}.jsonl.zst"


class HoldingStore(DirectoryStore):
    """A real directory store; once the segment's file is written, a person sets a legal hold on one of its runs:
    the race between a pass's reading and its commit."""

    def __init__(self, root, world, run, *, refuse_deletes=False):
        super().__init__(root)
        self.world, self.run, self.refuse_deletes = world, run, refuse_deletes

    def put(self, key, data):
        super().put(key, data)
        legal_hold_set(tenant=Tenant.objects.get(pk=self.world.acme.pk), run=self.run, held=True, actor="user:ada",
                       why="litigation, set mid-pass")

    def delete(self, key):
        if self.refuse_deletes:
            raise PermissionError("Object Lock: this object is write-once")
        super().delete(key)


@pytest.mark.parametrize("refuse_deletes", [False, True], ids=["store_deletes", "write_once_store"])
def test_a_hold_set_while_a_pass_writes_keeps_the_run_and_leaves_no_stray_segment(tools, signing, refuse_deletes):
    first, second = completed_run(tools, "first"), completed_run(tools, "second")
    age(first, second)
    retain(tools)
    events = AuditEvent.objects.filter(tenant=tools.acme).count()
    store = HoldingStore(signing, tools, second, refuse_deletes=refuse_deletes)
    report = archive(tools, store=store)
    assert report.runs == 0 and not report.segments
    assert f"run {second.pk} of tenant acme is no longer due" in report.stopped, report.stopped
    assert hot(first) and hot(second) and not ArchiveSegment.objects.exists() and not ArchivedRun.objects.exists()
    # Only the hold's own event was added to the chain; nothing else of the pass committed.
    assert AuditEvent.objects.filter(tenant=tools.acme).count() == events + 1
    left = store.names(tools.acme.pk)
    if refuse_deletes:
        assert len(left) == 1 and "stays in the archive (PermissionError" in report.stopped, report.stopped
    else:
        assert left == [] and "its file was removed" in report.stopped, report.stopped
    assert verify_chain(tools.acme.pk).ok


@pytest.fixture
def rests(tools, signing, monkeypatch):
    """Three settled runs past retention, and the rests a pass asks for (recorded, not slept)."""
    from ledger.archive import service

    age(*[completed_run(tools, f"paced-{n}") for n in range(3)])
    retain(tools)
    asked = []
    monkeypatch.setattr(service.time, "sleep", asked.append)
    return asked


def test_a_paced_pass_rests_after_each_segment_for_its_share(tools, rests):
    report = archive(tools, segment_runs=1, pace=0.25)
    assert report.runs == 3 and len(report.segments) == 3
    # After the first two segments, not the last: three times what each took (working a quarter of the time).
    assert len(rests) == 2 and all(rest > 0 for rest in rests) and report.rested == pytest.approx(sum(rests))
    assert verify_chain(tools.acme.pk).ok
    with pytest.raises(ValidationFailed):
        archive(tools, pace=0)
    for bad in ("0", "1.5", "-1"):
        with pytest.raises(CommandError, match="--pace is the share of its time"):
            call_command("archive", "--pace", bad, stdout=io.StringIO())


def test_an_unpaced_pass_never_rests(tools, rests):
    out = io.StringIO()
    call_command("archive", stdout=out)
    assert rests == [] and "archived 3 run(s)" in out.getvalue() and "resting" not in out.getvalue()


def limit_tool(world, limits):
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    spec = dict(in_process_policy()["tools"]["hr.create_user"], limits=limits)
    tool_upsert(tenant=world.acme, name="hr.create_user", spec=spec, actor="user:ada")


@pytest.mark.parametrize("limits, archived", [
    ([{"per": "run", "count": 5}], True),  # a budget per run ends with its run
    ([{"per": "tenant", "count": 100, "window": "1h"}], True),  # its step is older than the window
    ([{"per": "agent", "count": 100, "window": "1h"}, {"per": "tenant", "count": 100, "window": "366d"}], False),
    ([{"per": "tenant", "count": 100}], False),  # counted for all time: the run stays hot for good
], ids=["per_run", "window_passed", "longest_window_not_passed", "all_time"])
def test_a_run_stays_hot_while_a_limit_may_still_count_its_steps(tools, signing, limits, archived):
    limit_tool(tools, limits)
    run = completed_run(tools, "limited")
    age(run)
    retain(tools)
    later = timezone.now() + timedelta(hours=2)  # the steps are two hours old by then
    report = archive(tools, now=later)
    assert (report.runs == 1) is archived and hot(run) is not archived, report
    report = verify_chain(tools.acme.pk)
    assert report.ok, report


def test_an_archived_step_gives_back_its_share_of_the_running_totals(tools, signing):
    """PostgreSQL keeps running totals for limits per agent and per tenant (migration 0022); archiving deletes the
    counted steps, which take their share back (0029): the totals say what the hot steps add up to, the chain
    verifies (it checks them), and a limit counts the same as before archiving for any moment after."""
    from ledger.policy import limits as limits_module

    budget = [{"per": "tenant", "count": 1000, "window": "1h"},
              {"per": "agent", "count": 100, "window": "1h"}]
    limit_tool(tools, budget)
    old, recent = completed_run(tools, "old"), completed_run(tools, "recent")
    age(old)
    retain(tools)
    later = timezone.now() + timedelta(minutes=30)  # the old run's steps still count at `later`: it stays
    assert archive(tools, now=later).runs == 0
    much_later = timezone.now() + timedelta(hours=2)
    tool = tools.acme.tools.get(name="hr.create_user", is_current=True)
    used_before = limits_module.used_by(tool.limits, tool_name=tool.name, run=recent, now=much_later)
    assert archive(tools, now=much_later).runs == 1 and not hot(old) and hot(recent)
    assert limits_module.used_by(tool.limits, tool_name=tool.name, run=recent, now=much_later) == used_before
    assert verify_chain(tools.acme.pk).ok, verify_chain(tools.acme.pk)
