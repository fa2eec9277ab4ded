"""Archive throughput on PostgreSQL (docs/archive.md): generate N onboarding sagas through the engine (one in ten
fails and is compensated), age them past a 90-day retention, and time `archive_tenant` moving them to segments in a
directory, with a profile of where the time goes. Prints one JSON object on stdout.

    BENCH_DB=archive_db_bench python bench/archive.py [runs]
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from datetime import timedelta

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import django_setup, log

STAGES = {  # where a pass spends its time: a function of the archive's own, by name
    "select due runs": "due_runs", "read rows": "_archive_batch", "encode + zstd": "encode",
    "write file": "put", "commit (index, delete, chain)": "_commit",
}


def main(runs: int) -> dict:
    archive_dir = tempfile.mkdtemp(prefix="unwind-archive-")
    key_file = os.path.join(archive_dir, "signing.pem")
    django_setup(UNWIND_ARCHIVE_URL=f"file://{archive_dir}/segments", UNWIND_AUDIT_SIGNING_KEY_FILE=key_file)
    from django.core.management import call_command
    from django.utils import timezone

    from bench.engine import Saga, tenant_with_tools
    from ledger.archive.service import archive_tenant
    from ledger.audit.export import generate_key_pair
    from ledger.models import Action, Attempt, AuditEvent, Run, Tenant
    from ledger.policy.versions import tenant_defaults_set

    call_command("migrate", verbosity=0)
    with open(key_file, "wb") as f:
        f.write(generate_key_pair()[0])
    tenant, agent, _ = tenant_with_tools(f"bench-archive-{int(time.time())}")
    saga = Saga(tenant, agent)
    started = time.perf_counter()
    for i in range(runs):
        saga.onboard(i, fail=i % 10 == 9)
    log(f"generated {runs} runs in {time.perf_counter() - started:.1f} s")
    past = timezone.now() - timedelta(days=100)
    Run.objects.filter(tenant=tenant).update(created_at=past, finished_at=past)
    tenant_defaults_set(tenant=tenant, values={"retention_seconds": 90 * 86400}, actor="bench")
    tenant = Tenant.objects.get(pk=tenant.pk)
    actions = Action.objects.filter(tenant=tenant).count()
    attempts = Attempt.objects.filter(action__tenant=tenant).count()
    events = AuditEvent.objects.filter(tenant=tenant).count()
    from django.db import connection

    queries = []

    def timed_query(execute, sql, params, many, context):
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            queries.append((time.perf_counter() - began, sql[:150]))

    if os.environ.get("BENCH_PROFILE", "1") == "0":
        with connection.execute_wrapper(timed_query):
            started = time.perf_counter()
            report = archive_tenant(tenant=tenant, actor="bench")
            seconds = time.perf_counter() - started
        for took, text in sorted(queries, reverse=True)[:12]:
            log(f"{took * 1000:8.1f} ms  {text}")
        log(f"{len(queries)} queries, {sum(t for t, _ in queries):.2f} s in the database")
        return {"runs": report.runs, "actions": report.actions, "seconds": round(seconds, 3),
                "actions_per_s": round(report.actions / seconds), "profiled": False}
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    report = archive_tenant(tenant=tenant, actor="bench")
    profile.disable()
    seconds = time.perf_counter() - started
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    log(out.getvalue())
    by_name = {}
    for (_, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        by_name[name] = max(by_name.get(name, 0.0), cumulative)
    stages = {stage: round(by_name.get(name, 0.0), 3) for stage, name in STAGES.items()}
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(f"{archive_dir}/segments") for f in files)
    return {"runs": report.runs, "actions": report.actions, "attempts": attempts, "events": events,
            "segments": len(report.segments), "seconds": round(seconds, 3),
            "actions_per_s": round(report.actions / seconds), "runs_per_s": round(report.runs / seconds),
            "archived_bytes": size, "archived_bytes_per_action": round(size / max(actions, 1)),
            "stages_cumulative_s": stages, "profiled": True}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000), indent=2))
