"""Issue 38, finding 5: the README is the front door, short and true (it had grown to 428 lines).

At most 300 lines: what Unwind is, then `make demo` and `make test`, the API in five lines, configuration, one
architecture picture and the latest measured figures; the details live in docs/ and the README links them
(tests/test_doc_links.py checks every link). What moved stays whole: every setting the configuration reads is in
docs/settings.md, and the sections other tests run or read are still there.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LIMIT = 300


def sections() -> dict[str, str]:
    text = README.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_the_readme_is_at_most_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= LIMIT, f"README.md is {len(lines)} lines; move details into docs/ and link them"


def test_it_opens_with_what_unwind_is_and_the_two_commands():
    opening = sections()[""]
    assert opening.startswith("# Unwind\n") and "Unwind gives AI agents a ROLLBACK" in opening
    commands = re.search(r"^```sh\n(.*?)^```", opening, re.S | re.M).group(1)
    assert [line.split()[:2] for line in commands.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_the_front_door_has_its_rooms():
    """The API in five lines of Python, configuration, one architecture picture, the latest figures."""
    parts = sections()
    api = re.search(r"^```python\n(.*?)^```", parts["The API in five lines"], re.S | re.M).group(1)
    assert len([line for line in api.splitlines() if line.strip()]) <= 7 and "run.act(" in api
    assert "docs/settings.md" in parts["Settings"] and "`DATABASE_URL`" in parts["Settings"]
    assert parts["Architecture"].count("```") == 2 and "ledger/" in parts["Architecture"]
    measured = parts["Measured: chaos and benchmarks"]
    for figure in ("seed\n716114", "commit c2f081c", "**100 %** (293/293)", "12.6 ms (8 commits"):
        assert figure.replace("\n", " ") in measured.replace("\n", " "), figure
    runnable = re.findall(r"^```bash runnable\n(.*?)^```", README.read_text(), re.S | re.M)
    assert runnable and runnable[0].startswith(". var/demo.env")  # tests/test_runnable_docs.py runs it
    assert "```sh\n" in parts["Running it for real"]  # tests/test_readme_production.py runs it


def test_every_setting_the_configuration_reads_is_documented_with_its_default():
    """What left the README's settings table is in docs/settings.md, each name in a row with its default."""
    names = set()
    for source in (ROOT / "config").glob("*.py"):
        names |= set(re.findall(r'\benv_\w+\(\s*"([A-Z][A-Z0-9_]+)"', source.read_text()))
    assert len(names) > 50, "the configuration's reader changed: find its variables again"
    rows = [line for line in (ROOT / "docs" / "settings.md").read_text().splitlines() if line.startswith("| `")]
    missing = sorted(name for name in names if not any(f"`{name}`" in row.split(" | ")[0] for row in rows))
    assert missing == [], f"not in docs/settings.md: {missing}"
    assert all(len(row.split(" | ")) >= 3 for row in rows)  # variable | default | meaning


def test_the_demos_scenario_numbers_are_the_readmes():
    """`make demo` labels its checks and its list of runs by scenario ("5 rules"); a newcomer reads them beside the
    README's table, so each number names the same scenario in both (the demo once said 6 and 7 for the table's 5
    and 6)."""
    source = (ROOT / "sandbox" / "demo.py").read_text()
    labels = set(re.findall(r'(?:\bs = |ctx\.runs\[)"(\d) ([a-z]+)"', source))
    table = sections()["What the demo shows"]
    rows = dict(re.findall(r"^\| (\d) \| ([^|]+) \|", table, re.M))
    assert rows and labels
    for number, word in labels:
        if number in rows:
            assert word in rows[number].lower(), (number, word, rows[number])
        else:  # the charge left in the inbox: named in the paragraph after the table
            assert f"scenario {number} in the demo's list" in table, (number, word)
    assert set(rows) <= {number for number, _ in labels}
