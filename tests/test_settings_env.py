"""DATABASE_URL: what a newcomer types becomes the DATABASES entry Django needs, or a clear error."""
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.env import database_from_url

BASE = Path("/srv/unwind")


def test_postgres_options_are_typed_as_the_backend_expects():
    db = database_from_url("DATABASE_URL", "postgres://u:p%40ss@db:6432/unwind?conn_max_age=60"
                           "&server_side_binding=true&prepare_threshold=5&sslmode=require", base_dir=BASE)
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == ("unwind", "u", "p@ss", "db", "6432")
    assert db["CONN_MAX_AGE"] == 60
    assert db["OPTIONS"] == {"server_side_binding": True, "prepare_threshold": 5, "sslmode": "require"}


def test_postgres_binds_on_the_server_and_prepares_by_default_and_can_be_told_not_to():
    assert database_from_url("DATABASE_URL", "postgres://localhost/unwind", base_dir=BASE)["OPTIONS"] == {
        "server_side_binding": True, "prepare_threshold": 5}
    options = database_from_url("DATABASE_URL", "postgres://localhost/unwind?server_side_binding=false"
                                "&prepare_threshold=none", base_dir=BASE)["OPTIONS"]
    assert options == {"server_side_binding": False, "prepare_threshold": None}


@pytest.mark.parametrize("query, words", [
    ("server_side_binding=yes", "must be true or false"),
    ("prepare_threshold=often", "whole number of uses"),
    ("prepare_threshold=-1", "whole number of uses"),
    ("conn_max_age=-1", "whole number of seconds"),
])
def test_a_mistyped_option_says_which_and_why(query, words):
    with pytest.raises(ImproperlyConfigured, match=words):
        database_from_url("DATABASE_URL", f"postgres://localhost/unwind?{query}", base_dir=BASE)


def test_a_url_without_a_database_or_of_another_kind_is_refused():
    with pytest.raises(ImproperlyConfigured, match="names no database"):
        database_from_url("DATABASE_URL", "postgres://localhost", base_dir=BASE)
    with pytest.raises(ImproperlyConfigured, match="must start with"):
        database_from_url("DATABASE_URL", "mysql://localhost/x", base_dir=BASE)
