"""`manage.py policy_try FILE --tool NAME --args '{...}'`: what a tool's rules decide for these arguments."""
import json

from django.core.management.base import BaseCommand, CommandError

from ledger.engine import decision
from ledger.errors import UnwindError
from ledger.management.policy_files import read_policy_file
from ledger.models import Risk, Run, Tool
from ledger.policy.document import parse_document
from ledger.db.received import loads
from ledger.engine.proposal import validate_args


class Command(BaseCommand):
    help = ("Print the decision a tool's rules in a policy file give for the arguments, and the rules that fired. "
            "Reads no ledger and writes nothing: limits, which count the ledger at proposal time, are listed, not "
            "counted.")

    def add_arguments(self, parser):
        parser.add_argument("file")
        parser.add_argument("--tool", required=True)
        parser.add_argument("--args", required=True, dest="call_args", help="the call's arguments as JSON")
        parser.add_argument("--threshold", default=Risk.HIGH, choices=Risk.values,
                            help="the tenant's approval threshold (default: high)")
        parser.add_argument("--goal", default="", help="run.goal")
        parser.add_argument("--on-behalf-of", default="", help="run.on_behalf_of")
        parser.add_argument("--agent", default="", help="agent.name")
        parser.add_argument("--steps", type=int, default=0, help="run.steps: steps the run recorded before")

    def handle(self, *args, file, tool, threshold, goal, on_behalf_of, agent, steps, **options):
        try:
            parsed = parse_document(read_policy_file(file))
        except UnwindError as exc:
            raise CommandError(f"{file}: {exc.detail}") from None
        fields = parsed.tools.get(tool)
        if fields is None:
            raise CommandError(f"{file} has no tool {tool!r} (it has: {', '.join(sorted(parsed.tools))})")
        subject = Tool(name=tool, version=0, **fields)
        try:
            call = validate_args(subject, loads(options["call_args"]))
        except ValueError as exc:
            raise CommandError(f"--args is not JSON: {exc}") from None
        except UnwindError as exc:
            raise CommandError(f"--args: {exc.detail}") from None
        run = Run(goal=goal, on_behalf_of=on_behalf_of, next_seq=steps + 2)
        decided = decision.decide(tool=subject, run=run, args=call, threshold=threshold, count_limits=False,
                                  agent_name=agent)
        if decided.denied:
            verdict = f"refused: {decided.denied}"
        elif decided.required:
            verdict = f"needs {decided.required} approval{'s' if decided.required > 1 else ''} (risk {decided.risk})"
        else:
            verdict = f"runs without approval (risk {decided.risk})"
        self.stdout.write(f"{tool}: {verdict}")
        for line in decision.sentences(decided.record, display=subject.display, args=call):
            self.stdout.write(f"  {line['policy']}" + (f" — {line['values']}" if line["values"] else ""))
        for entry in decided.record["fired"]:
            how = "could not be decided" if entry.get("error") else "fired"
            self.stdout.write(f"  rule {entry['rule']} {how}: {entry['when']}  read {json.dumps(entry['read'])}")
        if not decided.record["fired"]:
            self.stdout.write("  no rule fired")
        for limit in subject.limits:
            self.stdout.write(f"  limit (counted at proposal time, not here): {json.dumps(limit)}")
