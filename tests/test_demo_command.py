"""`manage.py demo` starts from a clean database only when it is the demo's own: a user's database is never removed."""
from pathlib import Path
from types import SimpleNamespace

from sandbox.management.commands import demo
from sandbox.management.commands.demo import DEMO_DATABASE, demo_database_to_clear

SQLITE = "django.db.backends.sqlite3"


def test_only_the_demos_own_sqlite_file_is_cleared():
    assert demo_database_to_clear({"ENGINE": SQLITE, "NAME": str(DEMO_DATABASE)}, keep=False) == DEMO_DATABASE
    assert demo_database_to_clear({"ENGINE": SQLITE, "NAME": str(DEMO_DATABASE)}, keep=True) is None
    unwind = DEMO_DATABASE.parent / "unwind.sqlite3"  # `make run`'s database
    assert demo_database_to_clear({"ENGINE": SQLITE, "NAME": str(unwind)}, keep=False) is None
    assert demo_database_to_clear({"ENGINE": SQLITE, "NAME": "/srv/data/demo.sqlite3"}, keep=False) is None
    assert demo_database_to_clear({"ENGINE": "django.db.backends.postgresql", "NAME": "demo"}, keep=False) is None


def test_a_fresh_start_removes_the_demo_database_and_its_mail_and_nothing_else(tmp_path, monkeypatch):
    own = tmp_path / "demo.sqlite3"
    mine = tmp_path / "mine.sqlite3"
    for path in (own, Path(f"{own}-wal"), mine):
        path.write_text("x")
    mail = tmp_path / "demo-mail"
    mail.mkdir()
    (mail / "1.log").write_text("a message")
    monkeypatch.setattr(demo, "DEMO_DATABASE", own)
    monkeypatch.setattr(demo, "MAIL_DIR", mail)
    configured = SimpleNamespace(BASE_DIR=tmp_path, DATABASES={"default": {"ENGINE": SQLITE, "NAME": str(mine)}})
    monkeypatch.setattr(demo, "settings", configured)  # the command's view of the settings, not the tests' own
    monkeypatch.setattr(demo, "connections", SimpleNamespace(close_all=lambda: None))
    command = demo.Command()
    command.start_afresh(keep=False)
    assert mine.exists() and own.exists() and mail.exists()  # not the demo's own: kept
    configured.DATABASES["default"]["NAME"] = str(own)
    command.start_afresh(keep=True)
    assert own.exists() and mail.exists()
    command.start_afresh(keep=False)
    assert not own.exists() and not Path(f"{own}-wal").exists() and not mail.exists() and mine.exists()
