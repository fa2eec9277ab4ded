"""CI runs the PostgreSQL suite as shards side by side (`--shard K/N`, tests/conftest.py): together the shards run
every test exactly once, and each module's tests stay in one shard."""
from types import SimpleNamespace

import pytest

from tests.conftest import deal_shard


def config(shard):
    deselected = []
    return SimpleNamespace(getoption=lambda name: shard,
                           hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
                           deselected=deselected)


ITEMS = [SimpleNamespace(nodeid=f"tests/test_{module}.py::test_{n}") for module in "abcdefg" for n in range(3)]


def test_the_shards_run_every_test_once_and_keep_modules_whole():
    seen = []
    for k in (1, 2, 3):
        items = list(ITEMS)
        cfg = config(f"{k}/3")
        deal_shard(cfg, items)
        assert len(items) + len(cfg.deselected) == len(ITEMS)
        seen.append({item.nodeid.split("::")[0] for item in items})
    assert sorted(item.nodeid for shard in seen for item in ITEMS if item.nodeid.split("::")[0] in shard) == \
        sorted(item.nodeid for item in ITEMS)
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])
    assert [len(shard) for shard in seen] == [3, 2, 2]


def test_no_shard_keeps_every_test():
    items = list(ITEMS)
    deal_shard(config(None), items)
    assert items == ITEMS


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_a_shard_that_is_not_k_of_n_is_refused(bad):
    with pytest.raises(pytest.UsageError, match="expected K/N"):
        deal_shard(config(bad), list(ITEMS))
