"""`make bench` counts an engine function's call as a commit (bench/counting.py) by the shape of the one statement
that calls it (`fastpath.call_statement`). It once matched a list of names instead, missed a renamed writer
(`unwind_outcome`), and printed an ok saga's 8 commits as 5, timing the raw floor on 5 commits too."""
from bench.counting import FASTPATH
from ledger.engine import fastpath, plpgsql


def test_every_function_call_is_counted_as_a_commit_and_nothing_else_is():
    names = sorted(plpgsql.functions())
    assert "unwind_outcome" in names and "unwind_propose" in names
    missed = [name for name in names if not FASTPATH.search(fastpath.call_statement(name, "%s::bigint", "true"))]
    assert not missed, f"bench/counting.py would not count these calls as commits: {missed}"
    # A read that names a function outside that statement (the Python path's limits count) is not a commit.
    assert not FASTPATH.search("SELECT public.unwind_limits_used(%s::bigint, %s::bigint)")
