"""The agent API (under api/v1/), its OpenAPI schema and docs, and the health check."""
from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from ledger.api import actions, health, runs, tools

app_name = "api"

urlpatterns = [
    path("api/v1/tools", tools.ToolListView.as_view(), name="tool-list"),
    path("api/v1/tools/<name:name>", tools.ToolDetailView.as_view(), name="tool-detail"),
    path("api/v1/policy", tools.PolicyLoadView.as_view(), name="policy-load"),
    path("api/v1/runs", runs.RunListView.as_view(), name="run-list"),
    path("api/v1/runs/<id:run_id>", runs.RunDetailView.as_view(), name="run-detail"),
    path("api/v1/runs/<id:run_id>/cancel", runs.RunCancelView.as_view(), name="run-cancel"),
    path("api/v1/runs/<id:run_id>/complete", runs.RunCompleteView.as_view(), name="run-complete"),
    path("api/v1/runs/<id:run_id>/attempts", runs.RunAttemptsView.as_view(), name="run-attempts"),
    path("api/v1/runs/<id:run_id>/events", runs.RunEventsView.as_view(), name="run-events"),
    path("api/v1/runs/<id:run_id>/actions", actions.ActionProposeView.as_view(), name="run-actions"),
    path("api/v1/actions/<id:action_id>", actions.ActionDetailView.as_view(), name="action-detail"),
    path("api/v1/actions/<id:action_id>/wait", actions.ActionWaitView.as_view(), name="action-wait"),
    path("api/v1/actions/<id:action_id>/report", actions.ActionReportView.as_view(), name="action-report"),
    path("api/v1/compensations/pending", actions.PendingCompensationsView.as_view(), name="compensations-pending"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api:schema"), name="docs"),
    path("healthz", health.HealthView.as_view(), name="healthz"),
]
