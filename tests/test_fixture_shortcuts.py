"""The shortcuts tests/conftest.py's fixtures take keep what they skip: a schema's check is skipped only once it has
been found valid, and only inside the fixtures' loads."""
import pytest

from ledger.policy import schemas
from tests.conftest import schemas_checked_once


def test_an_invalid_schema_is_refused_every_time_and_only_a_valid_one_is_remembered():
    check = schemas.check
    with schemas_checked_once():
        for _ in range(2):
            with pytest.raises(schemas.ValidationFailed, match="not a valid JSON Schema"):
                schemas.check({"type": "object", "properties": {"n": {"type": 5}}}, where="tools.x.args_schema")
        schemas.check({"type": "object", "properties": {"n": {"type": "integer"}}}, where="tools.x.args_schema")
    assert schemas.check is check
    with pytest.raises(schemas.ValidationFailed):
        schemas.check({"type": "object", "properties": {"n": {"type": 5}}}, where="tools.x.args_schema")
