from django.apps import AppConfig


class SandboxConfig(AppConfig):
    name = "sandbox"

    def ready(self):
        # The sandbox's in-process tools join Unwind's Python registry (ledger.policy.registry) with the app.
        from sandbox import callables  # noqa: F401
