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
