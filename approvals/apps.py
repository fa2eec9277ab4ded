from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"

    def ready(self):
        from approvals import services
        from ledger import events

        events.subscribe("approval_required", services.on_approval_required)
        events.subscribe("approval_withdrawn", services.on_approval_withdrawn)
        events.subscribe("compensation_failed", services.on_compensation_failed)
        events.subscribe("sweep", services.on_sweep)
        events.subscribe("policy_changed", services.on_policy_changed)

        from approvals.api import approvals_of_actions
        from ledger.api import links

        links.register_approval_lookup(approvals_of_actions)

        # The audit chain fingerprints every request and decision (ledger/audit/chain.py): edited or forged in the
        # database behind the services' back, they fail `verify_audit`.
        from approvals.models import ApprovalDecision, ApprovalRequest
        from ledger.audit.chain import register_fingerprinted

        register_fingerprinted(ApprovalRequest, fields=APPROVAL_REQUEST_FIELDS, kinds=(
            "approval.requested", "approval.approve", "approval.reject", "approval.expired", "approval.withdrawn"))
        register_fingerprinted(ApprovalDecision, fields=APPROVAL_DECISION_FIELDS,
                               kinds=("approval.approve", "approval.reject"), tenant_lookup="request__tenant_id")

        # A run with a pending request or a message still to send stays in the hot tables (docs/archive.md).
        from ledger.archive.retention import register_keeps_hot

        register_keeps_hot(runs_with_open_approvals)


def runs_with_open_approvals(run_ids) -> set[int]:
    from approvals.models import ApprovalRequest, ApprovalStatus, Notification, NotificationStatus

    pending = set(ApprovalRequest.objects.filter(run_id__in=run_ids, status=ApprovalStatus.PENDING)
                  .values_list("run_id", flat=True))
    return pending | set(Notification.objects.filter(request__run_id__in=run_ids, status__in=[NotificationStatus.PENDING, NotificationStatus.SENDING])
                         .values_list("request__run_id", flat=True))


# What an approver is shown and what was decided: the preview and the hash it binds to, who asked, the quorum,
# the outcome; and each person's decision with its reason.
APPROVAL_REQUEST_FIELDS = (
    "run_id", "action_id", "is_compensation", "args_hash", "preview", "risk", "requested_by", "required", "status",
    "expires_at", "decided_at", "outcome_reason",
)
APPROVAL_DECISION_FIELDS = ("request_id", "user_id", "decision", "reason", "created_at")
