"""Propose a policy file from an upstream MCP server's tool list, for a person to review and then load.

It connects to a server the deployer declared (UNWIND_MCP_SERVERS), lists its tools and writes YAML: each tool's
name, description, argument schema (the upstream's inputSchema) and executor `{kind: mcp, server, tool}`. What
only a person can decide (saga role, risk, compensation) is left as comments, and every tool needs a person's
approval (`approval: manual`) until someone decides otherwise. Upstream annotations are hints, never policy: a
tool the upstream calls read-only (readOnlyHint) is proposed as `action_class: read_only`, destructiveHint and
idempotentHint are shown as comments. Nothing is written to the database: `manage.py load_tools FILE` does that,
run by a person after review.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import yaml
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ledger.executors import mcp as mcp_upstream
from ledger.policy import schemas
from ledger.models import Tenant
from ledger.policy.tool_entry import TOOL_NAME

HEADER = """\
# A policy proposal from the MCP server {server!r} ({where}), written by
# `manage.py import_mcp_tools {server} --tenant {tenant}` on {when}.
#
# Review every tool before loading this file (`manage.py load_tools FILE --tenant {tenant}`):
# - saga_role, risk and compensation are left for you (see each tool's comments); until you set them a tool is
#   compensatable, low risk, with nothing to undo it;
# - every tool needs a person's approval (approval: manual) until you decide otherwise;
# - annotations from the upstream (readOnlyHint, destructiveHint, idempotentHint) are its own claims, shown as hints;
# - the upstream is not assumed to honour Unwind's idempotency key (sent in _meta as "unwind/idempotency_key"):
#   a call whose outcome is lost goes to a person. Set idempotency.honours_key: true only if it deduplicates by it.
"""

TODO = """\
# Decide, then uncomment:
# saga_role: compensatable   # compensatable (undone on failure) | pivot (the point of no return) | retriable
# risk: low                  # low | medium | high | critical
# compensation: {strategy: twin, tool: <the tool that undoes this one>, args: {<its arg>: $result.<field>}}
"""


def unwind_name(server: str, upstream: str) -> str:
    """`server.tool`, in the characters an Unwind tool name allows (an MCP name may also hold "/")."""
    name = re.sub(r"[^A-Za-z0-9_.:-]", ".", f"{server}.{upstream}")[:120]
    return name if TOOL_NAME.match(name) else "mcp." + name[:116]


def hints(tool) -> list[str]:
    notes = tool.annotations
    if notes is None:
        return ["# upstream annotations: none"]
    said = [f"{label}={'true' if value else 'false'}" for label, value in (
        ("readOnlyHint", notes.read_only_hint), ("destructiveHint", notes.destructive_hint),
        ("idempotentHint", notes.idempotent_hint), ("openWorldHint", notes.open_world_hint)) if value is not None]
    return [f"# upstream annotations: {', '.join(said) or 'none'}"]


def proposal(server: str, tool) -> tuple[str, dict, list[str]]:
    """(Unwind name, the policy fields a machine may fill, comment lines for the person)."""
    comments = hints(tool)
    schema = tool.input_schema or {"type": "object"}
    try:
        schemas.check(schema, where="inputSchema")
    except Exception as why:  # noqa: BLE001 - shown to the person, who must fix the schema before loading
        comments.append(f"# WARNING: Unwind refuses this inputSchema as it stands: {why}")
    fields: dict = {"description": (tool.description or "").strip(),
                    "executor": {"kind": "mcp", "server": server, "tool": tool.name},
                    "args_schema": schema, "approval": "manual"}
    read_only = tool.annotations is not None and tool.annotations.read_only_hint is True
    if read_only:
        fields["action_class"] = "read_only"
        comments.append("# the upstream says it only reads: proposed as read_only (nothing to undo; may come anywhere "
                        "in a run). Check that it is so.")
    else:
        if tool.annotations is not None and tool.annotations.destructive_hint is True:
            comments.append("# the upstream says it is destructive: weigh a higher risk, and what could undo it")
        comments.extend(TODO.rstrip("\n").split("\n"))
    return unwind_name(server, tool.name), fields, comments


def render(server: mcp_upstream.Server, tenant: str, tools: list) -> str:
    where = server.url or f"stdio: {server.command}"
    parts = [HEADER.format(server=server.name, where=where, tenant=tenant,
                           when=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
             yaml.safe_dump({"tenant": tenant}, sort_keys=False), "tools:\n"]
    if not tools:
        parts.append("  {}  # the server lists no tools\n")
    seen: set[str] = set()
    for tool in tools:
        name, fields, comments = proposal(server.name, tool)
        if name in seen:
            comments.append(f"# WARNING: {name!r} is proposed twice (names differing only in characters Unwind does "
                            f"not allow); rename one")
        seen.add(name)
        body = yaml.safe_dump({name: fields}, sort_keys=False, allow_unicode=True, width=100)
        head, _, rest = body.partition("\n")
        parts.append("  " + head + "\n")
        parts.extend(f"    {line}\n" for line in comments)
        parts.extend(f"  {line}\n" for line in rest.rstrip("\n").split("\n") if line)
        parts.append("\n")
    return "".join(parts)


class Command(BaseCommand):
    help = ("List a declared upstream MCP server's tools and write a policy proposal (YAML) for a person to review "
            "and load with load_tools. Never writes policy to the database.")

    def add_arguments(self, parser):
        parser.add_argument("server", help="a server declared in UNWIND_MCP_SERVERS")
        parser.add_argument("--tenant", required=True, help="the tenant the proposal is for (its slug)")
        parser.add_argument("--out", help="write the proposal to this file (default: standard output); an existing "
                                          "file is never overwritten")
        parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server (default 30)")

    def handle(self, *args, server, tenant, out=None, timeout=30.0, **options):
        if not Tenant.objects.filter(slug=tenant).exists():
            raise CommandError(f"tenant {tenant!r} does not exist (create it with: manage.py create_tenant {tenant})")
        try:
            upstream = mcp_upstream.server(server)
        except (mcp_upstream.NotDeclared, ImproperlyConfigured) as why:
            raise CommandError(str(why)) from None
        if out and Path(out).exists():
            raise CommandError(f"{out} exists; a proposal never overwrites a file (a reviewed policy, perhaps)")
        try:
            tools = mcp_upstream.list_tools(upstream, timeout=timeout)
        except mcp_upstream.Unreachable as why:
            raise CommandError(f"MCP server {server!r} could not be reached: {why}") from None
        except TimeoutError:
            raise CommandError(f"MCP server {server!r} did not list its tools within {timeout:g}s") from None
        text = render(upstream, tenant, tools)
        if out:
            Path(out).write_text(text)
            self.stderr.write(f"wrote {len(tools)} tool(s) from {server!r} to {out}: review it, then "
                              f"`manage.py load_tools {out} --tenant {tenant}`")
        else:
            self.stdout.write(text, ending="")
