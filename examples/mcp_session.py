#!/usr/bin/env python
"""An MCP client session against Unwind's MCP server (`make demo`): list, call, approval, failure and unwind, rollback.

Start the demo in one terminal (`make demo`), then in another:

  . var/demo.env
  .venv/bin/python examples/mcp_session.py

It connects to $UNWIND_URL/mcp (`. var/demo.env` sets it to the demo's address; without it http://127.0.0.1:8000)
with the agent's key ($UNWIND_AGENT_KEY, else the demo's var/demo-agent.key) as a Bearer token, using the official
`mcp` client over streamable HTTP, and runs three short runs:

  1. approval  unwind_begin, hr.create_user, then payments.charge: high risk, so it needs a person. The call
               answers at once, pending, with the approval URL; the script then waits with unwind_status (progress
               every second while it waits), the demo's approver approves through the approvals API meanwhile (or,
               with --approver '', you decide at the URL), the wait answers with the charge, and it commits the run.
  2. unwind    hr.create_user, licenses.provision, then email.send while the email service is down (a fault the
               demo's operator injects into the sandbox): the step fails, Unwind revokes the license and deletes
               the user, newest first; the tool error says so, and the sandbox shows no user is left.
  3. rollback  hr.create_user, then unwind_rollback: the user is deleted again.

Options: --url (or UNWIND_URL), --key (or UNWIND_AGENT_KEY; default: var/demo-agent.key), --approver and --operator
(username:password of the tenant's people; the demo's by default). A server that cannot be reached, or that refuses
the key, ends the script with one line saying which and what to do (exit status 1), not a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import httpx2
import requests
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parent.parent
ONBOARD = {"email": "ashu@example.com", "name": "Ashu Kumar"}


def show(title: str, result) -> dict:
    payload = result.structured_content or json.loads(result.content[0].text)
    flag = "TOOL ERROR" if result.is_error else "ok"
    print(f"  {title}: {flag}\n    " + json.dumps(payload, default=str)[:400])
    return payload


class Demo:
    def __init__(self, mcp: ClientSession, args):
        self.mcp, self.args = mcp, args
        self.base = args.url.rsplit("/mcp", 1)[0]

    async def call(self, title: str, name: str, arguments: dict | None = None, **options) -> tuple[bool, dict]:
        result = await self.mcp.call_tool(name, arguments or {}, **options)
        return result.is_error, show(title, result)

    async def approval(self) -> None:
        print("\n1. approval: a high-risk charge waits for a person")
        _, run = await self.call("begin", "unwind_begin", {"goal": "Onboard Ashu and charge the annual plan",
                                                           "on_behalf_of": "carol@example.com"})
        await self.call("create the user", "hr.create_user", ONBOARD)
        _, pending = await self.call("charge", "payments.charge", {"customer": "cus_ashu", "amount_cents": 12000})

        approving = []

        async def progress(done, total, message):
            print(f"    progress {done:g}/{total:g}: {message[:80]}")
            if self.args.approver and not approving:  # a person decides while the agent waits, once
                approving.append(run["run_id"])  # before the await: the next progress report must not decide again
                await asyncio.to_thread(self.approve_pending_charge, run["run_id"])

        if pending.get("pending"):
            print(f"    approve or reject at {pending['approval']['url']}; waiting with unwind_status")
            while True:
                _, now = await self.call("status (waits up to 30 s)", "unwind_status",
                                         {"action_id": pending["action_id"], "wait": 30}, progress_callback=progress)
                if not now.get("pending"):
                    break
        await self.call("commit", "unwind_commit")

    def approve_pending_charge(self, run_id: int) -> None:
        """What the approver does in the inbox (here through the approvals API): approve this run's charge."""
        user, password = self.args.approver.split(":", 1)
        waiting = requests.get(f"{self.base}/api/v1/approvals", params={"status": "pending"}, auth=(user, password),
                               timeout=10).json()["results"]
        charge = next((row for row in waiting if row["run"] == run_id and row["tool"] == "payments.charge"), None)
        if charge is None:
            print(f"    no charge of run {run_id} waits for {user}: decide at the URL above")
            return
        decided = requests.post(f"{self.base}/api/v1/approvals/{charge['id']}/approve", json={"reason": "within budget"},
                                auth=(user, password), timeout=10)
        print(f"    {user} approved approval {charge['id']}: HTTP {decided.status_code}")

    async def unwind(self) -> None:
        print("\n2. unwind: a failed step undoes what the run did")
        operator = tuple(self.args.operator.split(":", 1))
        await self.call("begin", "unwind_begin", {"goal": "Onboard Ashu", "on_behalf_of": "carol@example.com"})
        _, user = await self.call("create the user", "hr.create_user", {**ONBOARD, "email": "ashu2@example.com"})
        await self.call("provision a license", "licenses.provision", {"user_id": user["result"]["id"]})
        requests.post(f"{self.base}/sandbox/faults", auth=operator, timeout=10,
                      json={"tool": "email.send", "mode": "status", "status": 503, "times": 0}).raise_for_status()
        try:
            await self.call("send the welcome email (the email service is down)", "email.send",
                            {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi Ashu"})
        finally:
            requests.post(f"{self.base}/sandbox/faults/clear", json={"tool": "email.send"}, auth=operator, timeout=10)
        state = requests.get(f"{self.base}/sandbox/state", auth=operator, timeout=10).json()
        left = [u for u in state.get("users", []) if u.get("id") == user["result"]["id"]]
        print(f"    the sandbox's directory still holds that user: {bool(left)}")

    async def rollback(self) -> None:
        print("\n3. rollback: the agent changes its mind")
        await self.call("begin", "unwind_begin", {"goal": "Onboard Ashu again", "on_behalf_of": "carol@example.com"})
        await self.call("create the user", "hr.create_user", {**ONBOARD, "email": "ashu3@example.com"})
        await self.call("roll back", "unwind_rollback", {"reason": "the ticket was withdrawn"})


def check_server(url: str, key: str) -> None:
    """Exit with one line when nothing answers at `url`, or the server there refuses the key, before a session opens.

    An MCP endpoint answers a GET with the key 405 (sessions are POSTed) and a wrong key 401 before anything else.
    """
    base = url.rsplit("/mcp", 1)[0]
    try:
        answer = requests.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    except requests.RequestException as error:
        sys.exit(f"cannot reach Unwind at {base} ({error.__class__.__name__}): start `make demo`, then `. var/demo.env` "
                 "in this terminal, or pass --url with the address it serves")
    if answer.status_code in (401, 403):
        sys.exit(f"Unwind at {base} refused the agent key ({answer.status_code}: {problem(answer)}): `. var/demo.env` "
                 "sets the demo's key, or pass --key with a key of `manage.py create_agent`")
    if answer.status_code == 404 or answer.status_code >= 500:
        sys.exit(f"{url} is not an MCP server that answers (HTTP {answer.status_code}): is Unwind serving at {base}?")


def problem(answer: requests.Response) -> str:
    """The sentence of an application/problem+json answer, or its status line."""
    try:
        return str(answer.json().get("detail") or answer.reason)
    except ValueError:
        return answer.reason


def transport_failures(error: BaseException) -> list[BaseException]:
    """The connection failures inside what a session raised (the SDK raises them inside exception groups)."""
    if isinstance(error, BaseExceptionGroup):
        return [found for inner in error.exceptions for found in transport_failures(inner)]
    return [error] if isinstance(error, (httpx2.TransportError, httpx2.HTTPStatusError)) else []


async def main(args) -> None:
    # The SDK's public way to set headers: an httpx2 client of our own (long read timeout: a status call may wait).
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {args.key}"},
                                  timeout=httpx2.Timeout(30, read=300)) as http:
        async with streamable_http_client(args.url, http_client=http) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                tools = (await mcp.list_tools()).tools
                print(f"{len(tools)} tools:")
                for tool in tools:
                    print(f"  {tool.name:22s} {(tool.description or '').splitlines()[0][:70]}")
                demo = Demo(mcp, args)
                await demo.approval()
                await demo.unwind()
                await demo.rollback()


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("UNWIND_URL", "http://127.0.0.1:8000"),
                        help="the server's base URL (/mcp is added) or its MCP endpoint (default: $UNWIND_URL, which "
                             "`. var/demo.env` sets; `make demo PORT=8123` serves http://127.0.0.1:8123/mcp)")
    parser.add_argument("--key", default=os.environ.get("UNWIND_AGENT_KEY"))
    parser.add_argument("--approver", default="approver:approver-demo",
                        help="username:password of an approver; empty to decide yourself at the printed URL")
    parser.add_argument("--operator", default="operator:operator-demo",
                        help="username:password of an operator (injects the email outage)")
    args = parser.parse_args(argv)
    if not args.url.rstrip("/").endswith("/mcp"):
        args.url = args.url.rstrip("/") + "/mcp"
    if not args.key:
        key_file = ROOT / "var" / "demo-agent.key"
        if not key_file.exists():
            sys.exit("no agent key: start `make demo` first (it writes var/demo-agent.key), or pass --key")
        args.key = key_file.read_text().strip()
    return args


if __name__ == "__main__":
    options = arguments()
    check_server(options.url, options.key)
    try:
        asyncio.run(main(options))
    except BaseException as error:  # noqa: BLE001 - a connection lost mid-session is one line, anything else is raised
        failures = transport_failures(error)
        if not failures:
            raise
        sys.exit(f"lost the connection to Unwind at {options.url} ({failures[0].__class__.__name__}: {failures[0]})")
