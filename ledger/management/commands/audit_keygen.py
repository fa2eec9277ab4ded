"""`manage.py audit_keygen`: a new Ed25519 key pair for signing the audit chain's heads."""
import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from ledger.audit.export import generate_key_pair


class Command(BaseCommand):
    help = ("Write a new Ed25519 key pair for signing exported audit chain heads and print the public key "
            "(hand it to an auditor; point UNWIND_AUDIT_SIGNING_KEY_FILE at the private key).")

    def add_arguments(self, parser):
        parser.add_argument("private_key_file", help="where to write the private key (PEM, mode 0600); must not exist")
        parser.add_argument("--public-key-file", help="where to write the public key (PEM); default: <private>.pub")

    def handle(self, *args, private_key_file, public_key_file=None, **options):
        private_path = Path(private_key_file)
        public_path = Path(public_key_file) if public_key_file else private_path.with_name(private_path.name + ".pub")
        for path in (private_path, public_path):
            if path.exists():
                raise CommandError(f"{path} already exists: a signing key is never overwritten (choose another path)")
        private_pem, public_pem = generate_key_pair()
        private_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
        public_path.write_bytes(public_pem)
        self.stderr.write(f"private key: {private_path} (set UNWIND_AUDIT_SIGNING_KEY_FILE to it)\n"
                          f"public key:  {public_path} (for UNWIND_AUDIT_PUBLIC_KEY_FILE and the auditor)")
        self.stdout.write(public_pem.decode(), ending="")
