"""CI runs the SQLite and the PostgreSQL suites as shards side by side (`--shard K/N`, tests/conftest.py): together
the shards run every test exactly once, each module's tests stay in one shard, and the modules that start the demo in
this clone (its files in var/) share one."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import DEMO_FILES_MODULES, deal_shard


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


def test_the_modules_that_start_the_demo_here_share_the_last_shard():
    items = ITEMS + [SimpleNamespace(nodeid=f"tests/{name}.py::test_{n}") for name in sorted(DEMO_FILES_MODULES)
                     for n in range(2)]
    shards = []
    for k in (1, 2):
        kept = list(items)
        deal_shard(config(f"{k}/2"), kept)
        shards.append({item.nodeid.split("::")[0] for item in kept})
    demo = {f"tests/{name}.py" for name in DEMO_FILES_MODULES}
    assert all((Path(__file__).parent / f"{name}.py").exists() for name in DEMO_FILES_MODULES)
    assert demo <= shards[1] and not demo & shards[0]
    assert shards[0] | shards[1] == {item.nodeid.split("::")[0] for item in items} and not shards[0] & shards[1]


def test_no_shard_keeps_every_test():
    items = list(ITEMS)
    deal_shard(config(None), items)
    assert items == ITEMS


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_a_shard_that_is_not_k_of_n_is_refused(bad):
    with pytest.raises(pytest.UsageError, match="expected K/N"):
        deal_shard(config(bad), list(ITEMS))
