"""`manage.py runserver`, with Unwind's base URLs following the port it serves on (config/serving.py)."""
from django.contrib.staticfiles.management.commands.runserver import Command as StaticfilesRunserver
from django.core.management.base import CommandError

from config.serving import PortMismatch, follow_serving_port


class Command(StaticfilesRunserver):
    def run(self, **options):
        try:
            follow_serving_port(self.addr, self.port)
        except PortMismatch as mismatch:
            raise CommandError(str(mismatch)) from None
        super().run(**options)
