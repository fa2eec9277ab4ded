"""The live-server archive tests' fixture, loaded with `pytest_plugins = ["tests.archive_fixtures"]`
(test_archive_http.py, test_archive_reads_http.py); their helpers are in tests/helpers.py."""
import pytest

from ledger.engine.runs import run_complete
from recovery.trail import trail_link_create
from tests.helpers import act, archive_past_retention, archive_store_at, live_api, open_run


@pytest.fixture
def archived(tools, settings, tmp_path, live_server):
    """acme's agent booker with two completed runs (alpha: two steps, beta: one; a trail link each) archived, the
    live server's URL, alpha's step ids, and what the API answered for alpha's history and steps while it was hot
    (`hot`, by path)."""
    tools.archive_dir = archive_store_at(settings, tmp_path)
    tools.url = live_server.url
    runs = []
    for name in ("alpha-secret", "beta-secret"):
        run = open_run(tools, goal=f"onboard {name}")
        user = act(run, "hr.create_user", {"email": f"{name}@x.io", "name": name})
        if name == "alpha-secret":
            act(run, "licenses.provision", {"user_id": user.result["id"]})
        runs.append(run_complete(run=run, actor="agent:booker"))
    tools.link_alpha = trail_link_create(run=runs[0], user=tools.oscar)[1]
    tools.link_beta = trail_link_create(run=runs[1], user=tools.oscar)[1]
    tools.alpha_steps = list(runs[0].actions.order_by("seq").values_list("pk", flat=True))
    paths = [f"/api/v1/runs/{runs[0].pk}/attempts", f"/api/v1/runs/{runs[0].pk}/events",
             *(f"/api/v1/actions/{step}" for step in tools.alpha_steps)]
    tools.hot = {path: live_api(tools, path, tools.key).json() for path in paths}
    # The links were made at "now" and last UNWIND_TRAIL_LINK_MAX_AGE: they still open the archived trails.
    archive_past_retention(tools, runs)
    tools.alpha, tools.beta = runs
    return tools
