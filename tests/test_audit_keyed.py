"""Guarantee 9 against an insider: someone who can write to the database, but holds neither the audit key nor the
head-signing key, cannot rewrite, forge, edit behind the services' back or cut short the audit chain unseen.

Each test names the check `verify_chain` reports (link, hmac, key, fingerprint, export-signature, export-head)."""
import base64
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.db import models, transaction
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest
from approvals.services import approval_decide
from config.audit_keys import key_id
from ledger.audit import export as audit_export
from ledger.audit.chain import (
    TOOL_POLICY_FIELDS, TOOL_UNFINGERPRINTED_FIELDS, event_hash, fingerprinted_models,
    ledger_transaction,
)
from ledger.audit.verify import verify_chain
from ledger.canonical import dumps
from ledger.api.tools import policy_of
from ledger.models import Action, AuditEvent, AuditHead, Run, Tenant, Tool
from ledger.policy.versions import tenant_defaults_set, tool_upsert
from ledger.engine.sweep import sweep
from recovery.models import RecoveryItem
from recovery.services import recovery_close
from tests.helpers import act, fault, open_run
from tests.test_g05_crash_safety import ROOT, database_url

KEY_A = b"a" * 16 + b"-audit-key-number-one-0123456789"
KEY_B = b"b" * 16 + b"-audit-key-number-two-0123456789"


@pytest.fixture
def history(tools):
    """acme with a compensated run, an approval rejected by a person, and a recovery item closed by an operator."""
    run = open_run(tools, goal="onboard A")
    user = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"}, intent={"reasoning": "new hire"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=400)
    act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    gated = open_run(tools)
    act(gated, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2027-01-01"})
    act(gated, "payments.charge", {"customer": "c", "amount_cents": 100})
    approval_decide(request=ApprovalRequest.objects.get(run=gated), user=tools.alice, approve=False,
                    reason="too expensive")
    stuck = open_run(tools)
    act(stuck, "hr.create_user", {"email": "b@x.io", "name": "B"})
    fault("hr.delete_user", "status", status=400)
    fault("email.send", "status", status=400)
    act(stuck, "email.send", {"to": "b@x.io", "subject": "S", "body": "b"})
    recovery_close(item=RecoveryItem.objects.get(run=stuck), user=tools.oscar, reason="deleted the user by hand")
    assert verify_chain(tools.acme.pk).ok, verify_chain(tools.acme.pk)
    return tools


def broken(world, check: str) -> str:
    report = verify_chain(world.acme.pk)
    assert not report.ok, "the tampering went unnoticed"
    assert report.check == check, report
    return report.problem


# --- the attack: rewrite an event and recompute the whole chain without the key ---------------------------------

def plain_sha256(prev, event, data):
    """The event's body exactly as Unwind hashes it (the code is public), under plain SHA-256: no key needed."""
    body = dumps({"tenant": event.tenant_id, "seq": event.seq, "kind": event.kind, "actor": event.actor,
                  "run": event.run_ref, "action": event.action_ref, "data": data, "at": event.created_at.isoformat(),
                  "key": event.key_id})
    return hashlib.sha256((prev + body).encode()).hexdigest()


def recompute_chain(tenant, rehash, *, key_id_to=None):
    """What an insider with database access does after editing an event: every hash and the head, recomputed."""
    prev = "0" * 64
    for event in AuditEvent.objects.filter(tenant=tenant).order_by("seq"):
        if key_id_to is not None:
            event.key_id = key_id_to
        new = rehash(prev, event, event.data)
        AuditEvent.objects.filter(pk=event.pk).update(prev_hash=prev, hash=new, key_id=event.key_id)
        prev = new
    AuditHead.objects.filter(tenant=tenant).update(hash=prev)


def forge_actor(world):
    event = AuditEvent.objects.filter(tenant=world.acme, kind="approval.reject").get()
    AuditEvent.objects.filter(pk=event.pk).update(actor="user:ben")
    return event


def test_rewriting_an_actor_and_recomputing_the_chain_with_plain_sha256_is_detected(history):
    forge_actor(history)
    recompute_chain(history.acme, plain_sha256)
    problem = broken(history, "hmac")
    assert "event #1 " in problem and "HMAC" in problem  # the very first event no longer verifies


def test_recomputing_the_chain_with_an_hmac_under_a_guessed_key_is_detected(history, settings):
    forge_actor(history)
    wrong = b"w" * 40
    current = settings.UNWIND_AUDIT_KEY_ID  # the key id is public: the insider copies it, not the key
    recompute_chain(history.acme, lambda prev, e, data: event_hash(
        wrong, prev, key_id=current, tenant_id=e.tenant_id, seq=e.seq, kind=e.kind, actor=e.actor, run_ref=e.run_ref,
        action_ref=e.action_ref, data=data, created_at=e.created_at))
    assert "event #1 " in broken(history, "hmac")


def test_recomputing_the_chain_under_a_key_of_ones_own_is_refused_by_its_key_id(history):
    forge_actor(history)
    mine = b"m" * 40
    recompute_chain(history.acme, lambda prev, e, data: event_hash(
        mine, prev, key_id=key_id(mine), tenant_id=e.tenant_id, seq=e.seq, kind=e.kind, actor=e.actor,
        run_ref=e.run_ref, action_ref=e.action_ref, data=data, created_at=e.created_at), key_id_to=key_id(mine))
    problem = broken(history, "key")
    assert key_id(mine) in problem and "UNWIND_AUDIT_OLD_KEYS" in problem


def test_an_event_moved_out_of_the_chain_breaks_its_link(history):
    event = AuditEvent.objects.filter(tenant=history.acme).order_by("seq")[4]
    AuditEvent.objects.filter(pk=event.pk).update(prev_hash="f" * 64)
    assert f"event #{event.seq} does not link" in broken(history, "link")


# --- every field a person or a recovery decision reads is fingerprinted -----------------------------------------

def forged(field: models.Field, current):
    if isinstance(field, models.JSONField):
        return {"forged": True}
    if isinstance(field, models.BooleanField):
        return not current
    if isinstance(field, models.DateTimeField):
        return (current or timezone.now()).replace(year=2001)
    if isinstance(field, (models.IntegerField, models.FloatField)):
        return (current or 0) + 7
    return f"forged-{current}"[: field.max_length or 100]


def row_of(model, world):
    if model is ApprovalDecision:
        return ApprovalDecision.objects.filter(request__tenant=world.acme).first()
    if model is Action:
        return Action.objects.filter(tenant=world.acme, after__isnull=False, verification__isnull=False).first()
    return model._default_manager.filter(tenant=world.acme).order_by("pk").first()


# Written out here, not taken from ledger/audit/chain.py: leaving a field out of a fingerprint must fail its test.
FIELDS = [
    *[(Action, f) for f in ("args", "intent", "before", "after", "target_type", "target_id", "verification",
                            "compensation_plan", "result", "error_class", "error_message", "status", "args_hash",
                            "stopped_by")],
    *[(Run, f) for f in ("goal", "on_behalf_of", "intent", "status", "plan", "pivot_committed")],
    *[(Tool, f.name) for f in Tool._meta.concrete_fields
      if f.name not in ("id", "tenant", "created_at", "updated_at", "is_current")],
    *[(ApprovalRequest, f) for f in ("status", "outcome_reason", "decided_at", "preview", "args_hash", "required",
                                     "requested_by", "risk", "expires_at")],
    *[(ApprovalDecision, f) for f in ("decision", "reason", "created_at")],
    *[(RecoveryItem, f) for f in ("status", "resolution", "resolved_by", "resolved_at", "resolution_note", "reason",
                                  "detail", "suggestion", "risk", "tool_name")],
]


class _TakenBack(Exception):
    """Ends the savepoint of one field's edit: the next field is edited on the history as it was."""


def test_a_field_edited_behind_the_services_back_is_detected_and_its_row_named(history):
    """Each field of FIELDS edited in turn on one history (built once: 60 builds took 3-5 s each on a busy CI), each
    edit taken back (its savepoint rolled back) before the next; every one must be found and its row named."""
    missed = {}
    for model, name in FIELDS:
        row = row_of(model, history)
        field = model._meta.get_field(name)
        value = forged(field, getattr(row, field.attname))
        label = {Action: "action", Run: "run"}.get(model, model._meta.label_lower)
        try:
            with transaction.atomic():
                # A plain queryset: someone with database access, not the models' own guards (tool versions refuse
                # edits).
                models.QuerySet(model=model).filter(pk=row.pk).update(**{field.attname: value})
                report = verify_chain(history.acme.pk)
                if report.ok or report.check != "fingerprint" or f"{label} {row.pk} differs" not in report.problem:
                    missed[f"{model.__name__}.{name}"] = "unnoticed" if report.ok else report.problem
                raise _TakenBack
        except _TakenBack:
            pass
        assert verify_chain(history.acme.pk).ok, f"{model.__name__}.{name}'s edit was not taken back"
    assert len(FIELDS) > 50 and not missed, missed


def test_an_old_tool_version_brought_back_behind_the_services_back_is_detected(history):
    tool_upsert(tenant=history.acme, name="payments.charge",
                spec={**policy_of(Tool.objects.get(tenant=history.acme, name="payments.charge")), "risk": "critical"},
                actor="user:ada")
    versions = models.QuerySet(model=Tool).filter(tenant=history.acme, name="payments.charge")
    versions.update(is_current=False)
    versions.filter(version=1).update(is_current=True)
    assert "payments.charge runs version 1 but its newest recorded version is 2" in broken(history, "policy")


def test_tenant_defaults_changed_beside_their_versions_are_detected(history):
    tenant_defaults_set(tenant=history.acme, values={"approval_threshold": "medium"}, actor="user:ada")
    Tenant.objects.filter(pk=history.acme.pk).update(approval_threshold="critical")
    assert "the tenant's defaults differ from their version 1" in broken(history, "policy")


def test_the_recovery_resolution_and_the_approval_decision_are_among_the_fingerprinted_fields():
    fields = {spec.model: spec.fields for spec in fingerprinted_models()}
    assert {"decision", "reason", "user_id"} <= set(fields[ApprovalDecision])
    assert {"status", "outcome_reason", "preview", "args_hash"} <= set(fields[ApprovalRequest])
    assert {"resolution", "resolved_by", "resolution_note"} <= set(fields[RecoveryItem])


def test_every_tool_field_is_fingerprinted_or_explicitly_left_out():
    """A field a Tool gains is policy until someone says otherwise: it must join TOOL_POLICY_FIELDS."""
    concrete = {f.name for f in Tool._meta.concrete_fields}
    assert concrete == set(TOOL_POLICY_FIELDS) | set(TOOL_UNFINGERPRINTED_FIELDS)


def test_a_decision_inserted_behind_the_services_back_is_detected(history):
    request = ApprovalRequest.objects.get(tenant=history.acme, status="rejected")
    decision = ApprovalDecision.objects.create(request=request, user=history.ben, decision="approve", reason="sure")
    assert f"approvals.approvaldecision {decision.pk} has no audit event" in broken(history, "fingerprint")


def test_a_tool_event_without_its_tools_fingerprint_is_detected(history):
    with ledger_transaction(history.acme.pk) as audit:
        audit.record("tool.updated", actor="user:x", tool="hr.create_user")
    assert "carries no fingerprint of its ledger.tool row" in broken(history, "fingerprint")


# --- signed heads exported outside the database -------------------------------------------------------------

@pytest.fixture
def signing(settings, tmp_path):
    key_file = tmp_path / "keys" / "audit-signing.pem"
    call_command("audit_keygen", str(key_file), stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
    settings.UNWIND_AUDIT_SIGNING_KEY_FILE = str(key_file)
    settings.UNWIND_AUDIT_PUBLIC_KEY_FILE = str(key_file) + ".pub"
    settings.UNWIND_AUDIT_EXPORT_DIR = str(tmp_path / "heads")
    return tmp_path / "heads"


def exported_lines(heads, tenant) -> list[dict]:
    return [json.loads(line) for line in (heads / f"tenant-{tenant.pk}.jsonl").read_text().splitlines()]


def note(world, n: int) -> None:
    """Events that fingerprint no row: cutting them off leaves every ledger row matching its last fingerprint."""
    with ledger_transaction(world.acme.pk) as audit:
        for i in range(n):
            audit.record("test.note", actor="user:oscar", n=i)


def cut_chain_to(world, seq: int) -> None:
    AuditEvent.objects.filter(tenant=world.acme, seq__gt=seq).delete()
    AuditHead.objects.filter(tenant=world.acme).update(
        seq=seq, hash=AuditEvent.objects.get(tenant=world.acme, seq=seq).hash)


def test_the_checkpoint_appends_a_signed_head_per_tenant_and_never_rewrites(history, signing):
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    first = (signing / f"tenant-{history.acme.pk}.jsonl").read_text()
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))  # nothing new: nothing written
    assert (signing / f"tenant-{history.acme.pk}.jsonl").read_text() == first
    note(history, 1)
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    text = (signing / f"tenant-{history.acme.pk}.jsonl").read_text()
    assert text.startswith(first)
    lines = exported_lines(signing, history.acme)
    head = AuditHead.objects.get(tenant=history.acme)
    assert [line["seq"] for line in lines] == [head.seq - 1, head.seq] and lines[-1]["hash"] == head.hash
    assert lines[-1]["slug"] == "acme" and lines[-1]["key_id"] and lines[-1]["sig"]
    assert exported_lines(signing, history.globex)[-1]["tenant"] == history.globex.pk
    report = verify_chain(history.acme.pk)
    assert report.ok and report.exported_head == head.seq


def test_cutting_the_chain_below_the_exported_head_is_detected(history, signing, settings):
    note(history, 3)
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    head = AuditHead.objects.get(tenant=history.acme).seq
    cut_chain_to(history, head - 3)
    problem = broken(history, "export-head")
    assert f"below the signed head #{head}" in problem
    settings.UNWIND_AUDIT_EXPORT_DIR = ""  # without the export, the cut is invisible: the HMAC cannot see it
    assert verify_chain(history.acme.pk).ok


def test_a_head_line_signed_by_another_key_is_detected(history, signing, tmp_path):
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    note(history, 2)
    other = tmp_path / "other.pem"
    call_command("audit_keygen", str(other), stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    forger = load_pem_private_key(other.read_bytes(), password=None)
    line = dict(exported_lines(signing, history.acme)[-1], seq=999, hash="e" * 64)
    line.pop("sig")
    line["sig"] = base64.b64encode(forger.sign(dumps(line).encode())).decode()
    with open(signing / f"tenant-{history.acme.pk}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    assert "invalid signature" in broken(history, "export-signature")


def test_an_altered_head_line_is_detected(history, signing):
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    path = signing / f"tenant-{history.acme.pk}.jsonl"
    line = json.loads(path.read_text().splitlines()[-1])
    path.write_text(json.dumps(dict(line, seq=line["seq"] + 5)) + "\n")
    assert "invalid signature" in broken(history, "export-signature")


def test_a_chain_rewritten_from_the_exported_head_on_is_detected(history, signing, settings):
    """Even a holder of the audit key (not of the signing key) cannot swap the exported head event."""
    call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    head = AuditHead.objects.get(tenant=history.acme)
    forge = AuditEvent.objects.get(tenant=history.acme, seq=head.seq)
    key = settings.UNWIND_AUDIT_KEYS[forge.key_id]
    new = event_hash(key, forge.prev_hash, key_id=forge.key_id, tenant_id=forge.tenant_id, seq=forge.seq,
                     kind=forge.kind, actor="user:someone-else", run_ref=forge.run_ref, action_ref=forge.action_ref,
                     data=forge.data, created_at=forge.created_at)
    AuditEvent.objects.filter(pk=forge.pk).update(actor="user:someone-else", hash=new)
    AuditHead.objects.filter(tenant=history.acme).update(hash=new)
    assert f"event #{head.seq} is not the signed head" in broken(history, "export-head")


def test_the_worker_sweep_signs_heads_at_its_interval(history, signing, settings):
    settings.UNWIND_AUDIT_CHECKPOINT_SECONDS = 3600
    audit_export._last_periodic["at"] = None
    sweep()
    assert exported_lines(signing, history.acme)[-1]["seq"] == AuditHead.objects.get(tenant=history.acme).seq
    note(history, 1)
    sweep()  # within the interval: nothing signed
    assert len(exported_lines(signing, history.acme)) == 1


def test_a_head_that_is_not_an_authentic_event_is_never_signed(history, signing):
    AuditEvent.objects.filter(tenant=history.acme, seq=AuditHead.objects.get(tenant=history.acme).seq).update(
        actor="user:forged")
    with pytest.raises(CommandError, match="not an authentic event"):
        call_command("audit_checkpoint", stdout=open(os.devnull, "w"))
    assert not (signing / f"tenant-{history.acme.pk}.jsonl").exists()


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys):
    path = tmp_path / "k.pem"
    call_command("audit_keygen", str(path))
    out = capsys.readouterr().out
    assert out.startswith("-----BEGIN PUBLIC KEY-----") and out == (tmp_path / "k.pem.pub").read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and b"PRIVATE KEY" in path.read_bytes()
    with pytest.raises(CommandError, match="never overwritten"):
        call_command("audit_keygen", str(path))


# --- key rotation ----------------------------------------------------------------------------------------------

def use_keys(settings, current: bytes, *others: bytes):
    """`current` signs, `others` verify; the key the fixtures' first events were made with stays known."""
    first = settings.UNWIND_AUDIT_KEYS[DEV_KEY_ID]
    settings.UNWIND_AUDIT_KEY_ID = key_id(current)
    settings.UNWIND_AUDIT_KEYS = {key_id(k): k for k in (first, current, *others)}


DEV_KEY_ID = django_settings.UNWIND_AUDIT_KEY_ID  # the test settings' key, derived from SECRET_KEY


def test_after_a_key_rotation_the_chain_verifies_with_the_old_key_kept_and_names_it_when_it_is_not(
        tools, settings):
    use_keys(settings, KEY_A)
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    before = AuditEvent.objects.filter(tenant=tools.acme, key_id=DEV_KEY_ID).count()
    under_a = AuditEvent.objects.filter(tenant=tools.acme).count()
    use_keys(settings, KEY_B, KEY_A)  # rotate: B signs, A only verifies
    act(run, "licenses.provision", {"user_id": "usr_1"})
    ids = list(AuditEvent.objects.filter(tenant=tools.acme).order_by("seq").values_list("key_id", flat=True))
    assert set(ids[before:under_a]) == {key_id(KEY_A)} and set(ids[under_a:]) == {key_id(KEY_B)}
    assert verify_chain(tools.acme.pk).ok
    use_keys(settings, KEY_B)  # A dropped too early
    report = verify_chain(tools.acme.pk)
    assert not report.ok and report.check == "key" and key_id(KEY_A) in report.problem
    assert f"event #{before + 1} " in report.problem


def test_old_keys_are_read_from_the_environment_and_from_files(monkeypatch, tmp_path):
    from config.audit_keys import load_audit_keys

    (tmp_path / "old").write_bytes(KEY_A + b"\n")
    monkeypatch.setenv("UNWIND_AUDIT_KEY", KEY_B.decode())
    monkeypatch.setenv("UNWIND_AUDIT_OLD_KEYS", "c" * 40 + ", " + "d" * 40)
    monkeypatch.setenv("UNWIND_AUDIT_OLD_KEY_FILES", str(tmp_path / "old"))
    current, keys = load_audit_keys(secret_key="s", allow_dev_key=False)
    assert current == key_id(KEY_B)
    assert keys == {key_id(k): k for k in (KEY_B, b"c" * 40, b"d" * 40, KEY_A)}


# --- the process and the command ------------------------------------------------------------------------------

def start(env: dict) -> subprocess.CompletedProcess:
    code = "import django; django.setup()"
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "config.settings"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True, text=True)


def test_production_refuses_to_start_without_an_audit_key():
    production = {"DEBUG": "0", "SECRET_KEY": "s" * 50, "UNWIND_INSECURE_DEV_KEY": "0"}
    refused = start(production)
    assert refused.returncode != 0 and "UNWIND_AUDIT_KEY" in refused.stderr and "DEBUG is off" in refused.stderr
    short = start({**production, "UNWIND_AUDIT_KEY": "short"})
    assert short.returncode != 0 and "at least 32 characters" in short.stderr
    assert start({**production, "UNWIND_AUDIT_KEY": KEY_A.decode()}).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif("sqlite" in database_url() and ":memory:" in database_url(), reason="needs a database file or server")
def test_verify_audit_exits_zero_on_a_clean_chain_and_non_zero_naming_the_check(transactional_db, tools, settings,
                                                                                 tmp_path):
    use_keys(settings, KEY_A)
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    use_keys(settings, KEY_B, KEY_A)
    act(run, "licenses.provision", {"user_id": "usr_1"})
    dev = settings.UNWIND_AUDIT_KEYS[DEV_KEY_ID].decode()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DATABASE_URL": database_url(),
           "UNWIND_INSECURE_DEV_KEY": "1", "UNWIND_AUDIT_KEY": KEY_B.decode(), "UNWIND_AUDIT_OLD_KEYS": f"{KEY_A.decode()},{dev}"}

    def verify(**extra):
        return subprocess.run([sys.executable, "manage.py", "verify_audit"], cwd=ROOT, env={**env, **extra},
                              capture_output=True, text=True)

    clean = verify()
    assert clean.returncode == 0 and clean.stdout.startswith("ok: "), clean.stderr
    without_old = verify(UNWIND_AUDIT_OLD_KEYS=dev)
    assert without_old.returncode == 1 and f"'{key_id(KEY_A)}'" in without_old.stderr
    assert "[check: key]" in without_old.stderr
    Run.objects.filter(pk=run.pk).update(goal="something else")
    edited = verify()
    assert edited.returncode == 1 and f"run {run.pk} differs" in edited.stderr and "[check: fingerprint]" in edited.stderr
