"""A small client for the Unwind API (needs only `requests`).

    from unwind_client import Unwind

    unwind = Unwind("http://127.0.0.1:8000", api_key="uw_…")
    with unwind.run(goal="Onboard Ashu", on_behalf_of="carol@company.com") as run:
        user = run.act("hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
        run.act("licenses.provision", {"user_id": user["id"]})
"""
from unwind_client.client import Run, Unwind
from unwind_client.errors import (
    ActionError,
    ApprovalPending,
    InFlight,
    Refused,
    Rejected,
    ReportRequired,
    Unavailable,
    UnwindClientError,
    Unwound,
)

__all__ = [
    "ActionError", "ApprovalPending", "InFlight", "Refused", "Rejected", "ReportRequired", "Run", "Unavailable", "Unwind",
    "UnwindClientError", "Unwound",
]
