"""Verifying a tenant's audit chain: its sequence, links, HMACs, head, exported signed head and row fingerprints.

The chain is written by ledger/audit/chain.py; heads are signed and exported by ledger/audit/export.py. This module reads
both (the export only when UNWIND_AUDIT_EXPORT_DIR is set, so `cryptography` is loaded only then), and neither
imports it back.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from django.conf import settings

from ledger.engine import sql
from ledger.audit.chain import (
    ACTION_FIELDS, GENESIS, RUN_FIELDS, action_fingerprint, fingerprinted_models, row_fingerprint, event_hash,
    run_fingerprint,
)
from ledger.models import Action, AuditEvent, AuditHead, Run, Tenant, TenantPolicyVersion, Tool


@dataclass
class ChainReport:
    ok: bool
    events: int
    problem: str = ""
    check: str = ""  # which check failed: sequence, link, key, hmac, head, fingerprint, policy, attempt, export-signature,
    # export-head
    exported_head: int | None = None  # the seq of the signed head checked against, when there is one


class _Broken(Exception):
    def __init__(self, check: str, problem: str):
        super().__init__(problem)
        self.check, self.problem = check, problem


def verify_chain(tenant_id: int, *, keys: dict[str, bytes] | None = None) -> ChainReport:
    """Walk a tenant's chain: sequence, links, each event's HMAC under the key it names, the head, the newest signed
    head exported outside the database (when UNWIND_AUDIT_EXPORT_DIR is set), and the fingerprints of the rows."""
    keys = settings.UNWIND_AUDIT_KEYS if keys is None else keys
    state = {"events": 0, "exported": None}
    try:
        _verify(tenant_id, keys, state)
    except _Broken as broken:
        return ChainReport(False, state["events"], broken.problem, broken.check, state["exported"])
    return ChainReport(True, state["events"], exported_head=state["exported"])


def _verify(tenant_id: int, keys: dict[str, bytes], state: dict) -> None:
    exported = None
    if settings.UNWIND_AUDIT_EXPORT_DIR:
        from ledger.audit import export as audit_export  # cryptography is loaded only where heads are signed or checked

        try:
            exported = audit_export.latest_head(tenant_id)
        except audit_export.ExportInvalid as exc:
            raise _Broken("export-signature", str(exc)) from None
        state["exported"] = exported["seq"] if exported else None
    prev = GENESIS
    expected_seq = 0
    last_action: dict[int, tuple[str, int]] = {}
    last_run: dict[int, tuple[str, int]] = {}
    last_row: dict[str, dict[str, tuple[str, int]]] = {spec.label: {} for spec in fingerprinted_models()}
    carried_by = {kind: spec for spec in fingerprinted_models() for kind in spec.kinds}
    events = AuditEvent.objects.filter(tenant_id=tenant_id).order_by("seq")
    for event in events.iterator(chunk_size=2000):
        state["events"] += 1
        expected_seq += 1
        if event.seq != expected_seq:
            raise _Broken("sequence", f"event #{expected_seq} is missing (next is #{event.seq}): deleted")
        if event.prev_hash != prev:
            raise _Broken("link", f"event #{event.seq} does not link to #{event.seq - 1}")
        key = keys.get(event.key_id)
        if key is None:
            named = event.key_id or "(none)"
            raise _Broken("key", f"event #{event.seq} was made with audit key id {named!r}, which is "
                                 "not configured: add that key to UNWIND_AUDIT_OLD_KEYS or UNWIND_AUDIT_OLD_KEY_FILES")
        recomputed = event_hash(key, prev, key_id=event.key_id, tenant_id=tenant_id, seq=event.seq, kind=event.kind,
                                actor=event.actor, run_ref=event.run_ref, action_ref=event.action_ref,
                                data=event.data, created_at=event.created_at)
        if not hmac.compare_digest(recomputed, event.hash):
            raise _Broken("hmac", f"event #{event.seq} ({event.kind}) was edited: its HMAC under key "
                                  f"{event.key_id} does not match (rewritten without the audit key)")
        data = event.data if isinstance(event.data, dict) else {}
        if event.action_ref is not None and "action_state" in data:
            last_action[event.action_ref] = (data["action_state"], event.seq)
        if event.run_ref is not None and "run_state" in data:
            last_run[event.run_ref] = (data["run_state"], event.seq)
        carried = data.get("rows") or {}
        spec = carried_by.get(event.kind)
        if spec is not None and not any(ref.startswith(spec.label + ":") for ref in carried):
            raise _Broken("fingerprint",
                          f"event #{event.seq} ({event.kind}) carries no fingerprint of its {spec.label} row")
        for ref, fingerprint in carried.items():
            label, _, pk = ref.rpartition(":")
            if label in last_row and fingerprint is None:
                last_row[label].pop(pk, None)  # removed by the services
            elif label in last_row:
                last_row[label][pk] = (fingerprint, event.seq)
        if exported is not None and event.seq == exported["seq"] and event.hash != exported["hash"]:
            raise _Broken("export-head", f"event #{event.seq} is not the signed head exported at {exported['at']}: "
                                         "the chain was rewritten from there on")
        prev = event.hash
    if exported is not None and expected_seq < exported["seq"]:
        raise _Broken("export-head", f"the chain ends at #{expected_seq}, below the signed head #{exported['seq']} "
                                     f"exported at {exported['at']}: events were removed")
    head = AuditHead.objects.filter(pk=tenant_id).first()
    if head is not None and (head.seq != expected_seq or head.hash != prev):
        raise _Broken("head", f"the chain ends at #{expected_seq} but its head says #{head.seq}: events were removed")
    _check_rows(Action.objects.filter(tenant_id=tenant_id), "action", ACTION_FIELDS,
                action_fingerprint,
                last_action, every_row_recorded=True)
    _check_rows(Run.objects.filter(tenant_id=tenant_id), "run", RUN_FIELDS, run_fingerprint, last_run,
                every_row_recorded=False)
    for spec in fingerprinted_models():
        recorded = {int(pk): value for pk, value in last_row[spec.label].items()}
        rows = spec.model._default_manager.filter(**{spec.tenant_lookup: tenant_id})
        _check_rows(rows, spec.label, spec.fields, row_fingerprint, recorded, every_row_recorded=True)
    _check_policy_in_force(tenant_id)
    _check_attempts(tenant_id)


# What a step's recorded status (fingerprinted in the chain) can be once one of its attempts succeeded: a success is
# recorded with its attempt's end in one transaction, and nothing moves a step back from there.
AFTER_SUCCESS = ("succeeded", "compensating", "compensated", "compensation_failed")


def _check_attempts(tenant_id: int) -> None:
    """An attempt is only as true as its step: one that says it succeeded belongs to a step the chain recorded as
    succeeded (a lost or failed step's attempt edited to success shows)."""
    found = sql.fetch_one(
        "SELECT t.number, a.id, a.status FROM ledger_attempt t JOIN ledger_action a ON a.id = t.action_id"
        f" WHERE a.tenant_id = %s AND t.outcome = 'succeeded' AND a.status NOT IN"
        f" ({', '.join(['%s'] * len(AFTER_SUCCESS))}) ORDER BY a.id, t.number LIMIT 1", [tenant_id, *AFTER_SUCCESS])
    if found is not None:
        number, action_id, status = found
        raise _Broken("attempt", f"attempt {number} of action {action_id} says it succeeded, but the action is "
                                 f"{status} in the audit chain: edited behind the services' back")


def _check_policy_in_force(tenant_id: int) -> None:
    """The policy the engine uses is the newest recorded version: an insider cannot bring back an old tool version
    (flipping `is_current`) or change the tenant's defaults beside their versions."""
    newest: dict[str, int] = {}
    current: dict[str, int] = {}
    for name, version, is_current in Tool.objects.filter(tenant_id=tenant_id).values_list(
            "name", "version", "is_current").iterator(chunk_size=2000):
        newest[name] = max(version, newest.get(name, 0))
        if is_current:
            if name in current:
                raise _Broken("policy", f"{name} has two current versions ({current[name]} and {version})")
            current[name] = version
    for name, version in sorted(newest.items()):
        if current.get(name) != version:
            raise _Broken("policy", f"{name} runs version {current.get(name)} but its newest recorded version is "
                                    f"{version}: changed behind the services' back")
    latest = TenantPolicyVersion.objects.filter(tenant_id=tenant_id).order_by("-version").first()
    if latest is None:
        # Every tenant stores its defaults from its creation (version 0; migration 0015 for older tenants).
        raise _Broken("policy", "the tenant has no recorded defaults version: its defaults (approval threshold, "
                                "approval TTL, idle timeout) cannot be checked, and were removed behind the "
                                "services' back")
    live = Tenant.objects.filter(pk=tenant_id).values_list(
        "approval_threshold", "approval_ttl_seconds", "run_idle_timeout_seconds", "local_part_case_sensitive",
        "subaddress_separators").first()
    if live != (latest.approval_threshold, latest.approval_ttl_seconds, latest.run_idle_timeout_seconds,
                latest.local_part_case_sensitive, latest.subaddress_separators):
        raise _Broken("policy", f"the tenant's defaults differ from their version {latest.version}: "
                                "changed behind the services' back")


def _check_rows(rows, label, fields, fingerprint, recorded, *, every_row_recorded: bool) -> None:
    seen = set()
    for row in rows.only(*fields).order_by("pk").iterator(chunk_size=2000):
        seen.add(row.pk)
        last = recorded.get(row.pk)
        if last is None:
            if every_row_recorded:
                raise _Broken("fingerprint", f"{label} {row.pk} has no audit event: written behind the services' back")
            continue
        if last[0] != fingerprint(row):
            raise _Broken("fingerprint", f"{label} {row.pk} differs from its state at event #{last[1]}: "
                                         "edited behind the services' back")
    missing = set(recorded) - seen
    if missing:
        raise _Broken("fingerprint", f"{label} {min(missing)} is in the audit chain but not in the ledger: deleted")
