"""In-process no-op tools for the benchmark: the onboarding saga of seed 001 with nothing behind it.

They do nothing but answer, so what is timed is Unwind itself (ledger, policy, audit chain), as the
DBOS reference times DBOS itself. `send_email` fails when its args say so, like the reference's third step.
They are registered as `bench.noop.<name>`; processes the benchmark starts import this module through
UNWIND_PYTHON_TOOL_MODULES (bench/common.py), as a deployment imports its own tools.
"""
from ledger.policy import registry

@registry.tool("bench.noop.create_user")
def create_user(args, *, idempotency_key, target, tenant):
    return {"id": f"u-{args['i']}"}


@registry.tool("bench.noop.delete_user")
def delete_user(args, *, idempotency_key, target, tenant):
    return {"deleted": args["user_id"]}


@registry.tool("bench.noop.provision")
def provision(args, *, idempotency_key, target, tenant):
    return {"id": f"lic-{args['user_id']}"}


@registry.tool("bench.noop.deprovision")
def deprovision(args, *, idempotency_key, target, tenant):
    return {"revoked": args["license_id"]}


@registry.tool("bench.noop.send_email")
def send_email(args, *, idempotency_key, target, tenant):
    if args.get("fail"):
        raise RuntimeError("Email API Gateway Timeout (504)")
    return {"sent": True}


@registry.tool("bench.noop.step")
def step(args, *, idempotency_key, target, tenant):
    if args.get("fail"):
        raise RuntimeError("step failed on purpose")
    return {"id": f"s-{args['n']}"}


@registry.tool("bench.noop.undo_step")
def undo_step(args, *, idempotency_key, target, tenant):
    return {"undone": args["id"]}


@registry.tool("bench.noop.noop")
def noop(args, *, idempotency_key, target, tenant):
    return {}


OBJECT = {"type": "object"}
POLICY = {
    "bench.create_user": {
        "executor": {"kind": "python", "path": "bench.noop.create_user"}, "risk": "low",
        "args_schema": {"type": "object", "required": ["i"], "properties": {"i": {"type": "integer"}}},
        "target": {"type": "user", "from": "result.id"},
        "compensation": {"strategy": "twin", "tool": "bench.delete_user", "args": {"user_id": "$result.id"}},
    },
    "bench.delete_user": {
        "executor": {"kind": "python", "path": "bench.noop.delete_user"}, "risk": "low",
        "args_schema": OBJECT, "target": {"type": "user", "from": "args.user_id"},
    },
    "bench.provision": {
        "executor": {"kind": "python", "path": "bench.noop.provision"}, "risk": "low",
        "action_class": "external_reversible", "args_schema": OBJECT, "target": {"type": "license", "from": "result.id"},
        "compensation": {"strategy": "twin", "tool": "bench.deprovision", "args": {"license_id": "$result.id"}},
    },
    "bench.deprovision": {
        "executor": {"kind": "python", "path": "bench.noop.deprovision"}, "risk": "low",
        "action_class": "external_reversible", "args_schema": OBJECT, "target": {"type": "license", "from": "args.license_id"},
    },
    "bench.send_email": {
        "executor": {"kind": "python", "path": "bench.noop.send_email"}, "risk": "low", "approval": "auto",
        "action_class": "external_irreversible", "saga_role": "retriable", "args_schema": OBJECT,
        "compensation": {"strategy": "none"},
    },
    "bench.step": {
        "executor": {"kind": "python", "path": "bench.noop.step"}, "risk": "low", "args_schema": OBJECT,
        "compensation": {"strategy": "twin", "tool": "bench.undo_step", "args": {"id": "$result.id"}},
    },
    "bench.undo_step": {
        "executor": {"kind": "python", "path": "bench.noop.undo_step"}, "risk": "low", "args_schema": OBJECT,
    },
    "bench.noop": {
        "executor": {"kind": "python", "path": "bench.noop.noop"}, "risk": "low", "args_schema": OBJECT,
        "compensation": {"strategy": "none"},
    },
}
