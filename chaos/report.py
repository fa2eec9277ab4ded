"""The integrity table: one column per broker, one row per figure."""
from __future__ import annotations


def _union(phases: list[dict], key: str) -> list[str]:
    names: list[str] = []
    for phase in phases:
        names += [name for name in phase.get(key, {}) if name not in names]
    return names


def _rows(phase: dict, phases: list[dict]) -> list[tuple[str, str]]:
    if "error" in phase:
        return [("error", phase["error"])]
    latency = phase.get("latency", {})
    audit = phase.get("audit", {})
    events = sum(a.get("events", 0) for a in audit.values())
    scenarios = phase.get("scenarios", [])
    rows = [
        ("setup", f"{phase['database']}, {phase['workers']} workers, {phase['web_processes']} web, {phase['agents']} agents"),
        ("runs", str(phase["runs"])),
        ("actions (steps + compensations)", str(phase["actions"])),
        ("faults injected", str(phase["faults_injected"])),
        *[(f"  {kind}", str(phase["faults"].get(kind, 0))) for kind in _union(phases, "faults")],
        ("outcomes", ""),
        *[(f"  {status}", str(phase["outcomes"].get(status, 0))) for status in sorted(_union(phases, "outcomes"))],
        *[(f"    needs_attention: {reason}", str(phase["attention_reasons"].get(reason, 0)))
          for reason in sorted(_union(phases, "attention_reasons"))],
        ("integrity (world matches outcome)", f"{phase['integrity_pct']:.2f}% ({phase['runs_ok']}/{phase['runs']})"),
        ("duplicate effects", str(phase["duplicate_effects"])),
        ("lost entries", str(phase["lost_entries"])),
        ("items for never-sent steps", str(phase.get("never_sent_items", "-"))),
        ("runs left running after the drain", str(phase.get("left_running", "-"))),
        ("wrong answers to agents", str(len(phase.get("wrong_answers", [])))),
        ("audit verification", f"{'ok' if phase['audit_ok'] else 'BROKEN'} ({events} events)"),
        ("scenarios passed", f"{sum(1 for s in scenarios if s['ok'])}/{len(scenarios)}"),
        ("drained after the faults", f"{'yes' if phase['drained'] else 'NO'} in {phase['drain_seconds']}s"),
        ("throughput", f"{phase['throughput_runs_per_s']} runs/s, {phase['throughput_steps_per_s']} steps/s"),
        ("step latency p50 / p99", f"{latency.get('p50_ms')} / {latency.get('p99_ms')} ms"),
        ("verdict", "PASS" if phase.get("passed") else "FAIL"),
    ]
    return rows


def table(phases: list[dict]) -> str:
    columns = [dict(_rows(phase, phases)) for phase in phases]
    labels: list[str] = []
    for phase in phases:
        for label, _ in _rows(phase, phases):
            if label not in labels:
                labels.append(label)
    headers = ["", *[f"{p['broker']} broker" for p in phases]]
    body = [[label, *[column.get(label, "-") for column in columns]] for label in labels]
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |", line]
    out += ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in body]
    out.append(line)
    failures = []
    for phase in phases:
        for scenario in phase.get("scenarios", []):
            if not scenario["ok"]:
                failures.append(f"[{phase['broker']}] scenario {scenario['name']}: {scenario['detail']}")
        for violation in phase.get("violations", [])[:15]:
            faults = ", ".join(f"{k}×{v}" for k, v in violation["faults_seen"].items()) or "none"
            failures.append(f"[{phase['broker']}] run {violation['run']} ({violation['status']}"
                            f"{': ' + violation['reason'] if violation['reason'] else ''}; faults seen: {faults}): "
                            + "; ".join(violation["problems"]))
        if len(phase.get("violations", [])) > 15:
            failures.append(f"[{phase['broker']}] … and {len(phase['violations']) - 15} more runs (see results.json)")
        for wrong in phase.get("wrong_answers", [])[:10]:
            failures.append(f"[{phase['broker']}] run {wrong['run']} answered: {wrong['answer']}")
        for item in phase.get("never_sent", [])[:10]:
            failures.append(f"[{phase['broker']}] {item}")
        for lost in phase.get("lost", [])[:10]:
            failures.append(f"[{phase['broker']}] lost: {lost}")
        for tenant, audit in phase.get("audit", {}).items():
            if not audit["ok"]:
                failures.append(f"[{phase['broker']}] audit of {tenant}: {audit['problem']}")
    if failures:
        out += ["", "What broke:", *[f"- {f}" for f in failures]]
    return "\n".join(out)
