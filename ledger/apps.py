from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "ledger"

    def ready(self):
        from ledger import audit, events

        # Signed chain heads are exported by the worker's sweep, off the request path.
        events.subscribe("sweep", audit.checkpoint_on_sweep)
