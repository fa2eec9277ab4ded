from importlib import import_module

from django.apps import AppConfig
from django.conf import settings
from django.db.models.signals import post_migrate


class LedgerConfig(AppConfig):
    name = "ledger"

    def ready(self):
        from ledger.executors import egress, mcp as mcp_upstream
        from ledger import events, tracing
        from ledger.engine import plpgsql

        # The deployer's in-process tools register themselves (ledger.policy.registry) when their module is imported:
        # once, here, from a setting, so that policy can only ever name what the deployment put there.
        for module in settings.UNWIND_PYTHON_TOOL_MODULES:
            import_module(module)
        egress.check_settings()
        mcp_upstream.check_settings()
        # Signed chain heads are exported by the worker's sweep, off the request path.
        events.subscribe("sweep", checkpoint_on_sweep)
        # Every migrate ends with the engine's PostgreSQL functions as their files define them (ledger/plpgsql).
        post_migrate.connect(plpgsql.install_after_migrate, sender=self, dispatch_uid="ledger.engine.plpgsql.install")
        tracing.setup()  # once per process, web and worker; nothing unless OTEL_* asks for traces
        dev_server_sends_at_once()
        # An archived step stays findable by its id (GET /api/v1/actions/{id}, MCP unwind_status): a key per step,
        # written with its run's index (ledger/archive/reader.py `archived_action`).
        from ledger.archive.service import register_archived_lookup
        from ledger.models import Action

        register_archived_lookup(Action, "id")


def dev_server_sends_at_once() -> None:
    """Django's development server (`runserver`: `make demo`, the TypeScript client's tests, the test suite's live
    server) answers a kept-alive request at once.

    It writes an answer's status and headers, then its body, with no buffer between; on a connection kept alive (a
    browser, requests.Session, the MCP and TypeScript clients) Nagle's algorithm held the body back until the client
    acknowledged the headers, which Linux delays by 40 ms: a kept-alive GET /healthz took 60 ms instead of 15.
    TCP_NODELAY on each connection it accepts (socketserver's own switch) sends each write as it is made; what is
    sent, and in which order, is the same. Production's server (gunicorn) sets it itself."""
    from django.core.servers.basehttp import WSGIRequestHandler

    WSGIRequestHandler.disable_nagle_algorithm = True


def checkpoint_on_sweep(*, now) -> None:
    """The worker's sweep signs and exports the heads (ledger/audit/export.py) when signing is configured; the
    signing code (and `cryptography`) is loaded only then, so no process starts slower for it."""
    if settings.UNWIND_AUDIT_EXPORT_DIR and settings.UNWIND_AUDIT_SIGNING_KEY_FILE:
        from ledger.audit import export as audit_export

        audit_export.on_sweep(now=now)
