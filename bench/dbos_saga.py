"""The peer: the onboarding saga of seed 001 in DBOS Transact, on the same PostgreSQL.

The workflow and steps are those of ../shared/anchors/dbos_saga.py. It runs as a long-lived child of
the benchmark so that its sagas can be timed in rounds interleaved with Unwind's and the floor's: it
reads commands on stdin (`ok N START`, `fail N START`, `quit`) and answers each with one JSON line of
per-saga seconds. DBOS keeps its system database (`dbos_saga_sys`, or `<BENCH_DB>_dbos`) on the same server.
"""
import json
import os
import sys
import time

from dbos import DBOS, DBOSConfig

base = os.environ.get("PG_URL", "postgresql://postgres@127.0.0.1:5432/unwind_bench").rsplit("/", 1)[0]
system = os.environ.get("BENCH_DBOS_DB", "dbos_saga_sys")  # bench/common.py's DBOS_DB, passed by the parent
config: DBOSConfig = {"name": "dbos_saga", "system_database_url": f"{base}/{system}", "log_level": "WARNING"}
DBOS(config=config)
world = {}


@DBOS.step()
def create_user(i):
    world[f"user{i}"] = True


@DBOS.step()
def delete_user(i):
    world.pop(f"user{i}", None)


@DBOS.step()
def provision(i):
    world[f"license{i}"] = True


@DBOS.step()
def deprovision(i):
    world.pop(f"license{i}", None)


@DBOS.step()
def send_email(i, fail):
    if fail:
        raise RuntimeError("Email API Gateway Timeout (504)")


@DBOS.workflow()
def onboard(i, fail):
    compensations = []
    try:
        create_user(i)
        compensations.append(delete_user)
        provision(i)
        compensations.append(deprovision)
        send_email(i, fail)
    except Exception:  # noqa: BLE001 - the reference saga: any failure of a step unwinds
        for undo in reversed(compensations):
            undo(i)
        return "compensated"
    return "completed"


def main():
    DBOS.launch()
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            break
        case, n, start = parts[0], int(parts[1]), int(parts[2])
        times = []
        for i in range(start, start + n):
            started = time.perf_counter()
            outcome = onboard(i, case == "fail")
            times.append(time.perf_counter() - started)
            assert outcome == ("completed" if case == "ok" else "compensated"), outcome
        print(json.dumps(times), flush=True)
    left = [k for k in world if not k.startswith(("user", "license"))]
    assert not left
    DBOS.destroy()


if __name__ == "__main__":
    main()
