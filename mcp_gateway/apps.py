from django.apps import AppConfig


class McpGatewayConfig(AppConfig):
    name = "mcp_gateway"
    verbose_name = "MCP gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from ledger import events
        from mcp_gateway import sessions

        # The worker's sweep removes ended sessions and idle ones whose run is over (mcp_gateway/sessions.py).
        events.subscribe("sweep", sessions.on_sweep)
