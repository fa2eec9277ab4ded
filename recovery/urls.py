from django.urls import path

from recovery import erasure_views, trail_views, views

app_name = "recovery"

urlpatterns = [
    path("recovery/", views.queue, name="queue"),
    path("recovery/bulk/", views.bulk, name="bulk"),
    path("recovery/<int:pk>/", views.item_detail, name="item"),
    path("recovery/<int:pk>/undo-plan/", views.item_undo_plan, name="undo_plan"),
    path("recovery/<int:pk>/<slug:operation>/", views.item_resolve, name="resolve"),
    path("runs/", views.runs, name="runs"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/trail/email/", trail_views.trail_email, name="trail_email"),
    path("runs/<int:pk>/trail/links/", trail_views.trail_link_new, name="trail_link_new"),
    path("runs/<int:pk>/trail/links/<int:link_id>/revoke/", trail_views.trail_link_revoke_view, name="trail_link_revoke"),
    path("trail/<str:token>/", trail_views.trail_share, name="trail_share"),
    path("trail/<str:token>/stop/<int:action_id>/", trail_views.trail_share_stop, name="trail_share_stop"),
    path("steps/<int:pk>/stop/", trail_views.hold_stop, name="hold_stop"),
    path("trail/<str:token>/ask/", trail_views.trail_share_ask, name="trail_share_ask"),
    path("requests/<int:pk>/reply/", trail_views.customer_request_reply_view, name="customer_request_reply"),
    path("outbox/", views.outbox, name="outbox"),
    path("outbox/<int:pk>/", views.outbox_message, name="outbox_message"),
    path("metrics/", views.metrics, name="metrics"),
    path("policy/", views.policy, name="policy"),
    path("erasure/", erasure_views.erasure, name="erasure"),
]
