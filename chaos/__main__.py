"""`python -m chaos` (`make chaos`): the fault and load suites against real processes, and the integrity table.

Each broker (ORM, then Redis) runs as a phase in a process of its own, on a database of its own that the
phase drops, creates and migrates. Options can also be given as environment variables (in brackets).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.report import table

ROOT = Path(__file__).resolve().parent.parent


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=float(env("CHAOS_MINUTES", "2")),
                        help="minutes of load in all, split between the brokers [CHAOS_MINUTES, 2]; scenarios, "
                             "start-up and the drain add about a minute and a half per broker")
    parser.add_argument("--agents", type=int, default=int(env("CHAOS_AGENTS", "8")),
                        help="concurrent agent threads [CHAOS_AGENTS, 8]")
    parser.add_argument("--workers", type=int, default=int(env("CHAOS_WORKERS", "4")),
                        help="`manage.py worker` processes [CHAOS_WORKERS, 4]")
    parser.add_argument("--web-processes", type=int, default=int(env("CHAOS_WEB_PROCESSES", "3")),
                        help="gunicorn worker processes [CHAOS_WEB_PROCESSES, 3]")
    parser.add_argument("--brokers", default=env("CHAOS_BROKERS", "orm,redis"),
                        help="comma-separated: orm, redis [CHAOS_BROKERS, orm,redis]")
    parser.add_argument("--database-url", default=env("CHAOS_DATABASE_URL", "private"),
                        help="the database; each broker gets its own, suffixed _orm or _redis, dropped and created. "
                             "'private' starts a PostgreSQL server of each phase's own (initdb, pg_ctl) on a free port, "
                             "which the database_restart and database_stall scenarios restart and freeze; on a "
                             "shared server they are not run [CHAOS_DATABASE_URL, private]")
    parser.add_argument("--redis-url", default=env("CHAOS_REDIS_URL", "private"),
                        help="Redis for the redis phase; 'private' starts a redis-server of the run's own on a free "
                             "port, which the broker_lost scenario stops and starts [CHAOS_REDIS_URL, private]")
    parser.add_argument("--seed", type=int, default=int(env("CHAOS_SEED", "0")) or random.randrange(1, 10**6),
                        help="random seed [CHAOS_SEED, random]")
    parser.add_argument("--drain-timeout", type=float, default=float(env("CHAOS_DRAIN_TIMEOUT", "180")),
                        help="seconds the workers get to drain after the faults stop [CHAOS_DRAIN_TIMEOUT, 180]")
    parser.add_argument("--results", default=env("CHAOS_RESULTS", str(ROOT / "chaos" / "results.json")),
                        help="where the table is written as JSON [CHAOS_RESULTS, chaos/results.json]")
    parser.add_argument("--log-dir", default=str(ROOT / "var" / "chaos"), help="process logs, per broker")
    # One phase, as the parent runs it in a process of its own.
    parser.add_argument("--phase", choices=["orm", "redis"], help=argparse.SUPPRESS)
    parser.add_argument("--load-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def phase_database(url: str, broker: str) -> str:
    if url == "private":
        return url  # each phase starts its own server
    if url.startswith("sqlite:"):
        stem, dot, suffix = url.rpartition(".")
        return f"{stem}_{broker}.{suffix}" if dot else f"{url}_{broker}"
    base, _, query = url.partition("?")
    return f"{base}_{broker}" + (f"?{query}" if query else "")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.phase:
        from chaos.runner import phase_main

        return phase_main(args)
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    unknown = set(brokers) - {"orm", "redis"}
    if unknown or not brokers:
        print(f"--brokers takes orm and/or redis, not {args.brokers!r}", file=sys.stderr)
        return 2
    load_seconds = max(15.0, args.minutes * 60 / len(brokers))
    print(f"chaos: seed {args.seed}; {args.agents} agents, {args.workers} workers, {args.web_processes} web processes; "
          f"{load_seconds:g}s of load per broker ({', '.join(brokers)})", flush=True)
    phases = []
    for broker in brokers:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
            out_path = Path(out.name)
        command = [sys.executable, "-m", "chaos", "--phase", broker, "--out", str(out_path),
                   "--load-seconds", str(load_seconds), "--agents", str(args.agents), "--workers", str(args.workers),
                   "--web-processes", str(args.web_processes), "--seed", str(args.seed),
                   "--drain-timeout", str(args.drain_timeout), "--redis-url", args.redis_url,
                   "--database-url", phase_database(args.database_url, broker),
                   "--log-dir", str(Path(args.log_dir) / broker)]
        finished = subprocess.run(command, cwd=ROOT)
        if finished.returncode != 0 or not out_path.stat().st_size:
            print(f"chaos: the {broker} phase failed (exit {finished.returncode}); logs in {args.log_dir}/{broker}",
                  file=sys.stderr)
            phases.append({"broker": broker, "error": f"phase exited with {finished.returncode}", "passed": False})
        else:
            phases.append(json.loads(out_path.read_text()))
        out_path.unlink(missing_ok=True)
    print()
    print(table(phases))
    document = {
        "generated_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seed": args.seed, "minutes": args.minutes, "agents": args.agents, "workers": args.workers,
        "web_processes": args.web_processes, "passed": all(p.get("passed") for p in phases), "phases": phases,
    }
    Path(args.results).write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwritten to {args.results}")
    return 0 if document["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
