"""How the chain keeps verifying after a person's data is erased (recovery/erasure.py writes it, `verify_chain` reads
it).

Erasure replaces the person's text in the rows of their runs and in the events of those runs with a marker. The rows'
new fingerprints, and a digest of each event as erasure left it, are recorded in the erasure's own event (`KIND`),
appended to the chain under the audit key like any other. `verify_chain` then holds:
- an event whose HMAC no longer matches passes only when a later authentic erasure event vouches for it exactly as it
  now stands (every column, its links included): an erased event edited again, or one erasure did not rewrite, still
  shows as edited;
- each erased row is compared with the fingerprint the erasure recorded; the seals of its steps (digests of the call
  as it was sent) are no longer recomputed from a row that no longer holds the call: a settled step is never sent
  again, and its row is held to its fingerprint.
"""
from __future__ import annotations

from ledger.canonical import digest
from ledger.models import AuditEvent

KIND = "subject.erased"


def vouch(event: AuditEvent) -> str:
    """A digest of everything stored of an event, as erasure left it."""
    return digest("rewritten", event.seq, event.kind, event.actor, event.run_ref, event.action_ref, event.data,
                  event.created_at.isoformat(), event.key_id, event.prev_hash, event.hash)


class Rewritten:
    """Events whose HMAC does not match, waiting for an erasure event that vouches for them. Only the events some
    erasure event names wait (read first, authentic or not: the one that vouches is checked when the walk reaches
    it); any other is reported at once, as always."""

    def __init__(self, tenant_id: int):
        self._pending: dict[int, tuple[str, str]] = {}
        self._named: set[int] = set()
        for data in AuditEvent.objects.filter(tenant_id=tenant_id, kind=KIND).values_list("data", flat=True):
            if isinstance(data, dict) and isinstance(data.get("rewritten"), dict):
                self._named.update(int(seq) for seq in data["rewritten"] if str(seq).isdigit())

    def pending(self, event: AuditEvent) -> bool:
        """Whether the event may wait for its voucher (False: it is reported now)."""
        if event.seq not in self._named:
            return False
        self._pending[event.seq] = (vouch(event), f"event #{event.seq} ({event.kind}) was edited: its HMAC under key "
                                                  f"{event.key_id} does not match (rewritten without the audit key)")
        return True

    def vouched(self, event: AuditEvent, data: dict, last_action: dict, last_run: dict, seals: dict,
                undo_seals: dict) -> None:
        for seq, recorded in (data.get("rewritten") or {}).items():
            waiting = self._pending.get(int(seq))
            if waiting is not None and waiting[0] == recorded:
                del self._pending[int(seq)]
        for ref, fingerprint in (data.get("erased_rows") or {}).items():
            label, _, pk = ref.partition(":")
            if label == "run":
                last_run[int(pk)] = (fingerprint, event.seq)
            elif label == "action":
                last_action[int(pk)] = (fingerprint, event.seq)
                seals.pop(int(pk), None)
                undo_seals.pop(int(pk), None)

    def unvouched(self) -> str:
        if not self._pending:
            return ""
        return self._pending[min(self._pending)][1]
