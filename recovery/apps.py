from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"

    def ready(self):
        from ledger import events
        from recovery import services

        events.subscribe("run_needs_attention", services.on_run_needs_attention)
        events.subscribe("run_attention_cleared", services.on_run_attention_cleared)
