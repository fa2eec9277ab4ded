from django.urls import path

from approvals import links

app_name = "approval_links"

urlpatterns = [
    path("approvals/link/<str:token>/", links.confirm, name="confirm"),
    path("integrations/slack/interactions/", links.slack_interactions, name="slack_interactions"),
]
