from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"

    def ready(self):
        from ledger import events
        from recovery import services

        events.subscribe("run_needs_attention", services.on_run_needs_attention)
        events.subscribe("run_attention_cleared", services.on_run_attention_cleared)

        from recovery import stops

        events.subscribe("action_held", stops.on_action_held)

        # The audit chain fingerprints every recovery item as opened and as resolved (ledger/audit/chain.py): a
        # resolution edited in the database behind the services' back fails `verify_audit`.
        from ledger.audit.chain import register_fingerprinted
        from recovery.models import RecoveryItem

        register_fingerprinted(RecoveryItem, fields=RECOVERY_ITEM_FIELDS, kinds=services.RECOVERY_EVENTS)
        # Who a hold notice may go to: an address added to the list in the database shows in `verify_audit`.
        from recovery import customers
        from recovery.models import KnownCustomerAddress

        register_fingerprinted(KnownCustomerAddress, fields=customers.FINGERPRINT_FIELDS,
                               kinds=(customers.ADDED, customers.REMOVED))

        # An archived run's trail link still opens its trail (read from its segment); a run with an open item or an
        # unanswered customer request stays in the hot tables (docs/archive.md).
        from ledger.archive.retention import register_keeps_hot
        from ledger.archive.service import register_archived_lookup
        from recovery.models import TrailShareLink

        register_archived_lookup(TrailShareLink, "token_hash")
        register_keeps_hot(runs_with_open_items)


def runs_with_open_items(run_ids) -> set[int]:
    from recovery.models import CustomerRequest, ItemStatus, RecoveryItem

    items = set(RecoveryItem.objects.filter(run_id__in=run_ids, status=ItemStatus.OPEN).values_list("run_id", flat=True))
    return items | set(CustomerRequest.objects.filter(run_id__in=run_ids, reply="").values_list("run_id", flat=True))


# What the operator is told (why, how risky, what to do) and what they decided, by whom, when and why.
RECOVERY_ITEM_FIELDS = (
    "run_id", "action_id", "reason", "risk", "tool_name", "detail", "suggestion", "status", "resolution",
    "resolved_by", "resolved_at", "resolution_note",
)
