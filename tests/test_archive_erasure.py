"""Issue 42: erasure and archiving together. A person's runs erased and then archived leave a chain that still
verifies across hot tables and segments, with none of their text in the segment; a person whose runs were already
archived is told what erasure could not reach (SECURITY.md), and the chain still verifies."""
import zstandard

from ledger.audit.verify import verify_chain
from ledger.models import Run
from recovery.erasure import subject_erase
from ledger.engine.runs import run_complete, run_open
from tests.helpers import act
from tests.test_archive import age, archive, retain, signing  # noqa: F401 (fixture)
from tests.test_erasure import DANA, GOAL, NAME, REASONING, SECRETS, other_run


def dana_run(world, capture):
    """Dana's run with no step of a limited tool (those stay hot while their limits may read them)."""
    run = run_open(tenant=world.acme, agent=world.agent, goal=GOAL, on_behalf_of=DANA, actor="agent:booker")
    act(run, "hr.create_user", {"email": DANA, "name": NAME},
        intent={"goal": GOAL, "reasoning": REASONING, "confidence": 0.9})
    act(run, "travel.book_flight", {"passenger": f"{NAME} Quillsworth", "flight": "LH1", "date": "2027-01-01"})
    return run_complete(run=run, actor="agent:booker")


def segment_text(folder) -> str:
    return "".join(zstandard.ZstdDecompressor().decompress(path.read_bytes(), max_output_size=1 << 30).decode()
                   for path in folder.rglob("*") if path.is_file() and not path.name.endswith(".json"))


def test_erased_then_archived_verifies_and_the_segment_holds_no_text_of_theirs(
        tools, signing, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks)
    other = other_run(tools)
    subject_erase(tenant=tools.acme, subject=DANA, reason="request #7", by="user:ada")
    age(run, other)
    retain(tools)
    report = archive(tools)
    assert report.runs == 2, report
    assert not Run.objects.filter(pk__in=[run.pk, other.pk]).exists()
    checked = verify_chain(tools.acme.pk)
    assert checked.ok, checked
    text = segment_text(signing)
    assert "erin@example.org" in text  # the search finds what is there
    assert not [secret for secret in SECRETS if secret.lower() in text.lower()]


def test_archived_then_erased_says_what_it_could_not_reach_and_verifies(
        tools, signing, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks)
    age(run)
    retain(tools)
    assert archive(tools).runs == 1
    result = subject_erase(tenant=tools.acme, subject=DANA.upper(), reason="request #8", by="user:ada")
    assert result.runs == 0
    assert f"1 archived run(s) of this person (run {run.pk}) stay in archive segment(s) 1" in result.sentence()
    assert "erasure does not rewrite archives" in result.sentence()
    checked = verify_chain(tools.acme.pk)
    assert checked.ok, checked


def test_an_archive_that_cannot_be_read_is_said_so_by_erasure(tools, signing, django_capture_on_commit_callbacks):
    """Erasure reads the archive's runs one segment at a time; a segment removed from the store is named as the
    reason it cannot say what stays archived, rather than an error or a claim that nothing does."""
    run = dana_run(tools, django_capture_on_commit_callbacks)
    age(run)
    retain(tools)
    assert archive(tools).runs == 1
    for path in signing.rglob("*.jsonl.zst"):
        path.unlink()
    result = subject_erase(tenant=tools.acme, subject=DANA, reason="request #9", by="user:ada")
    assert "The archive could not be read (segment 1 (" in result.sentence()
    assert "is missing from file://" in result.sentence() and "archived run(s) of this person" not in result.sentence()
