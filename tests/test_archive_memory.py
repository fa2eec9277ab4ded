"""Issue 42: verifying a tenant that has archived for years. `verify_audit` reads one segment at a time (twice: its
events during the walk, its rows after it), so its peak memory does not grow with the number of segments; what does
grow is the walk's state per step and row, small beside a segment (docs/archive.md)."""
import gc
import tracemalloc
from datetime import datetime, timezone

from ledger.archive import segments
from ledger.archive.store import segment_key
from ledger.audit.verify import verify_chain
from ledger.engine.runs import run_complete
from ledger.models import ArchiveSegment
from tests.helpers import act, open_run
from tests.test_archive import age, archive, retain, signing  # noqa: F401 (fixture)

# A step's arguments large beside what the walk keeps per step (its state, fingerprints, seals), as a real tool's
# can be: a segment's decoded content is then what a verification holding every segment would grow by.
BODY = "Welcome aboard. " * 1250  # 20,000 characters, the most email.send takes


def archived_runs(world, count: int, first: int) -> None:
    """`count` settled runs, archived one per segment."""
    runs = []
    for number in range(first, first + count):
        run = open_run(world, goal=f"bulk {number}")
        for n in range(2):
            act(run, "email.send", {"to": f"bulk{number}@x.io", "subject": f"welcome {n}", "body": BODY})
        runs.append(run_complete(run=run, actor="agent:booker"))
    age(*runs)
    assert archive(world, segment_runs=1).runs == count


def peak_while(read) -> tuple[object, int]:
    """What `read()` returns, and the most memory Python held at once while it ran."""
    gc.collect()
    tracemalloc.start()
    try:
        result = read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def verification_peak(world) -> int:
    assert verify_chain(world.acme.pk).ok  # a first pass warms what is loaded once (modules, caches)
    report, peak = peak_while(lambda: verify_chain(world.acme.pk))
    assert report.ok and report.segments == ArchiveSegment.objects.filter(tenant=world.acme).count(), report
    return peak


def test_verifying_holds_one_segment_at_a_time_however_many_there_are(tools, signing):
    """Three times the segments, of the same size: holding them all (events or rows) makes the peak about two to
    four times as high; holding one at a time leaves it within the growth of the walk's per-step state."""
    retain(tools)
    archived_runs(tools, 12, first=0)
    small = verification_peak(tools)
    archived_runs(tools, 24, first=12)
    assert ArchiveSegment.objects.filter(tenant=tools.acme).count() == 36
    large = verification_peak(tools)
    assert large < 1.5 * small + 64 * 1024, f"verifying 36 segments peaked at {large} bytes, 12 at {small}"


def test_a_segment_is_read_line_by_line_not_decompressed_whole():
    """The events of a segment whose rows are large are read without holding the rows' text: the lines stream
    through zstd's reader, and only those asked for are kept."""
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    events = [{"seq": seq, "kind": "run.opened", "actor": "agent:a", "run_ref": 1, "action_ref": None, "data": {},
               "created_at": at, "prev_hash": "0" * 64, "hash": "1" * 64, "key_id": "k1"} for seq in (1, 2)]
    rows = [("ledger.action", {"id": pk, "args_text": f"{pk:06d}" + "x" * 20000}) for pk in range(100)]
    data, _ = segments.encode({"number": 1, "first_seq": 1, "last_seq": 2}, events, rows)
    read, peak = peak_while(lambda: segments.decode(data, rows=False))
    assert [e["seq"] for e in read.events] == [1, 2] and read.rows == {}
    assert peak < 200_000, f"reading the events of a 2 MB segment held {peak} bytes at once"
    whole = segments.decode(data)
    assert [row["id"] for row in whole.rows["ledger.action"]] == list(range(100))
    assert len(whole.events) == 2 and whole.manifest["last_seq"] == 2


def test_a_segment_removed_or_changed_among_many_is_named_where_the_walk_reaches_it(tools, signing):
    retain(tools)
    archived_runs(tools, 6, first=0)
    files = [signing / segment_key(tools.acme.pk, s.sha256)
             for s in ArchiveSegment.objects.filter(tenant=tools.acme).order_by("number")]
    kept = files[3].read_bytes()
    files[3].unlink()
    report = verify_chain(tools.acme.pk)
    assert not report.ok and report.check == "archive" and report.problem.startswith("segment 4 (")
    assert "is missing from" in report.problem and "removed" in report.problem
    files[3].write_bytes(kept)
    changed = bytearray(files[4].read_bytes())
    changed[len(changed) // 2] ^= 0x01
    files[4].write_bytes(bytes(changed))
    report = verify_chain(tools.acme.pk)
    assert not report.ok and report.problem.startswith("segment 5 (") and "was changed" in report.problem, report


def test_a_segment_changed_between_the_walk_and_the_rows_is_named(tools, signing, monkeypatch):
    """The rows are read in a second pass: a segment must still hash to its name then."""
    from ledger.archive import chain

    retain(tools)
    archived_runs(tools, 3, first=0)
    second = segment_key(tools.acme.pk, ArchiveSegment.objects.get(tenant=tools.acme, number=2).sha256)
    store, fetched = chain.archive_store(), []

    class ChangedAfterTheWalk:
        """The directory store, but segment 2 has a bit flipped when it is read the second time."""
        where = store.where

        def get(self, key):
            fetched.append(key)
            data = store.get(key)
            if key == second and fetched.count(key) == 2:
                return data[:-1] + bytes([data[-1] ^ 0x01])
            return data

    monkeypatch.setattr(chain, "archive_store", ChangedAfterTheWalk)
    report = verify_chain(tools.acme.pk)
    assert not report.ok and report.check == "archive", report
    assert report.problem.startswith("segment 2 (") and "was changed" in report.problem, report
    assert len(fetched) == 5  # segments 1 to 3 for the walk, then 1 and 2 for their rows
