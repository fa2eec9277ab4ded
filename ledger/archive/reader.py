"""Reading an archived run back from its segment: for its console page, its trail link, the API and MCP
(docs/archive.md): the run, its history and its steps, and the index of the archived runs a caller may read.

Who may read it is decided as for a hot run, from the index (`ArchivedRun`: its tenant and agent; a step's run by its
`ArchivedKey`), before any segment is fetched. A fetched segment must hash to its name: one that does not is refused,
never shown.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

from ledger.archive import segments
from ledger.archive.chain import ArchivedEvent, archived_event, instance
from ledger.archive.store import archive_store, segment_key
from ledger.errors import ArchiveUnavailable, NotFound
from ledger.models import Action, ArchivedKey, ArchivedRun, ArchiveSegment, Attempt, Checkpoint, ErasedRun, Run

# The look-up key every archived step is indexed by (ledger/apps.py registers it): its id, with its run.
ACTION_KEY = Action._meta.label_lower

# Segments kept decoded in a process (a page and its trail read the same one again), each with its store's stamp of
# the object when it was fetched and hashed: a hit is served only while the stamp is unchanged, so a segment changed
# or removed after it was read is fetched and checked again (and refused), not served from memory.
_CACHED = 4
_cache: OrderedDict[tuple[str, str], tuple[str, segments.Segment]] = OrderedDict()
_lock = threading.Lock()


@dataclass
class ArchivedRunView:
    run: Run  # unsaved objects rebuilt from the segment's rows
    actions: list[Action]
    checkpoints: list[Checkpoint]
    attempts: list[Attempt]
    events: list[ArchivedEvent]
    rows: dict[str, list[dict]] = field(default_factory=dict)  # every row of the run, by model label
    archived_at: datetime | None = None
    segment: str = ""


def segment(index: ArchiveSegment, *, store=None) -> segments.Segment:
    store = store or archive_store()
    key = segment_key(index.tenant_id, index.sha256)
    stamp = store.stamp(key)
    with _lock:
        cached = _cache.get((store.where, index.sha256))
        if cached is not None and stamp is not None and cached[0] == stamp:
            _cache.move_to_end((store.where, index.sha256))
            return cached[1]
    data = store.get(key) if stamp is not None else None
    if data is None or hashlib.sha256(data).hexdigest() != index.sha256:
        with _lock:
            _cache.pop((store.where, index.sha256), None)
        why = "is missing" if data is None else "no longer hashes to its name"
        raise ArchiveUnavailable(f"archive segment {index.number} of the run's tenant {why}: run `manage.py "
                                 "verify_audit`")
    read = segments.decode(data)
    with _lock:
        _cache[(store.where, index.sha256)] = (stamp, read)
        while len(_cache) > _CACHED:
            _cache.popitem(last=False)
    return read


def archived_runs(*, tenant_ids: list[int], agent_id: int | None):
    """The index of the archived runs the caller may read (an agent: only its own), fetching no segment."""
    found = ArchivedRun.objects.filter(tenant_id__in=tenant_ids).select_related("segment")
    return found.filter(agent_id=agent_id) if agent_id is not None else found


def archived_entry(*, tenant_ids: list[int], agent_id: int | None, run_id: int) -> ArchivedRun | None:
    """The index entry of an archived run the caller may read, or None: who may read is decided here, from the
    index alone, before any segment is fetched."""
    return archived_runs(tenant_ids=tenant_ids, agent_id=agent_id).filter(pk=run_id).first()


def archived_run(*, tenant_ids: list[int], agent_id: int | None, run_id: int, store=None) -> ArchivedRunView:
    """An archived run the caller may read (an agent: only its own), or NotFound as for a run that never was."""
    entry = archived_entry(tenant_ids=tenant_ids, agent_id=agent_id, run_id=run_id)
    if entry is None:
        raise NotFound(f"there is no run {run_id}")
    return _view(entry, store=store)


def archived_action_entry(*, tenant_ids: list[int], agent_id: int | None, action_id: int) -> ArchivedRun | None:
    """The index entry of the archived run holding step `action_id`, if the caller may read that run."""
    key = ArchivedKey.objects.filter(label=ACTION_KEY, value=str(int(action_id))).select_related("run__segment").first()
    if key is None or key.run.tenant_id not in tenant_ids or (agent_id is not None and key.run.agent_id != agent_id):
        return None
    return key.run


def archived_action(*, tenant_ids: list[int], agent_id: int | None, action_id: int,
                    store=None) -> tuple[ArchivedRunView, Action]:
    """An archived step the caller may read (an agent: only in its own runs) with its run, or NotFound as for a
    step that never was. Steps are found by their index key (`ACTION_KEY`), which runs archived before it was
    registered do not have: theirs answer as missing."""
    entry = archived_action_entry(tenant_ids=tenant_ids, agent_id=agent_id, action_id=action_id)
    if entry is None:
        raise NotFound(f"there is no action {action_id}")
    view = _view(entry, store=store)
    for action in view.actions:
        if action.pk == action_id:
            return view, action
    raise ArchiveUnavailable(f"archive segment {entry.segment.number} does not hold action {action_id} of run "
                             f"{entry.run_id}")


def archived_row(label: str, value: str) -> tuple[ArchivedRunView, dict] | None:
    """The archived row of `label` another app finds by its key (a trail link by its token's hash), with its run."""
    key = ArchivedKey.objects.filter(label=label, value=value).select_related("run__segment").first()
    if key is None:
        return None
    view = _view(key.run)
    column = {"recovery.trailsharelink": "token_hash"}.get(label)
    for row in view.rows.get(label, []):
        if column is None or row.get(column) == value:
            return view, row
    return None


def _view(entry: ArchivedRun, *, store=None) -> ArchivedRunView:
    held = segment(entry.segment, store=store)
    owners = {"action_id": {a["id"]: a["run_id"] for a in held.rows.get("ledger.action", [])},
              "request_id": {r["id"]: r.get("run_id") for r in held.rows.get("approvals.approvalrequest", [])}}
    rows: dict[str, list[dict]] = {}
    for label, found in held.rows.items():
        mine = [row for row in found if _run_of(label, row, owners) == entry.run_id]
        if mine:
            rows[label] = mine
    run_rows = rows.get("ledger.run", [])
    if not run_rows:
        raise ArchiveUnavailable(f"archive segment {entry.segment.number} does not hold run {entry.run_id}")
    run = instance(Run, run_rows[0])
    actions = sorted((instance(Action, row) for row in rows.get("ledger.action", [])), key=lambda a: a.seq)
    for action in actions:
        action.run = run
    checkpoints = sorted((instance(Checkpoint, row) for row in rows.get("ledger.checkpoint", [])), key=lambda c: c.pk)
    steps = {action.pk: action for action in actions}
    attempts = sorted((instance(Attempt, row) for row in rows.get("ledger.attempt", [])),
                      key=lambda a: (a.action_id, a.number))
    for attempt in attempts:
        attempt.action = steps[attempt.action_id]
    # The erasure's row went with the run: read from it, as a hot run's is (ledger/api/selectors.py `erased_on`).
    erased = [instance(ErasedRun, row).erased_at for row in rows.get("ledger.erasedrun", [])]
    run.erased_on = erased[0] if erased else None
    return ArchivedRunView(run=run, actions=actions, checkpoints=checkpoints, attempts=attempts,
                           events=_events(entry, store=store), rows=rows, archived_at=entry.archived_at,
                           segment=entry.segment.sha256)


def _run_of(label: str, row: dict, owners: dict) -> int | None:
    """The run a row of the segment belongs to: its own column, or that of the step or request it hangs from."""
    if label == "ledger.run":
        return row["id"]
    if row.get("run_id") is not None:
        return row["run_id"]
    for column, runs in owners.items():
        if row.get(column) is not None:
            return runs.get(row[column])
    return None


def _events(entry: ArchivedRun, *, store=None) -> list[ArchivedEvent]:
    """The run's audit events, from the segments whose slices hold them."""
    found = []
    for index in ArchiveSegment.objects.filter(tenant_id=entry.tenant_id, last_seq__gte=entry.first_seq,
                                               first_seq__lte=entry.last_seq).order_by("number"):
        for line in segment(index, store=store).events:
            if line["run"] == entry.run_id:
                found.append(archived_event(line, index))
    return found
