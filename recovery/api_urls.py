from django.urls import path

from recovery import api

app_name = "recovery-api"

urlpatterns = [
    path("api/v1/recovery-items", api.RecoveryItemListView.as_view(), name="list"),
    path("api/v1/recovery-items/<id:pk>", api.RecoveryItemDetailView.as_view(), name="detail"),
    path("api/v1/recovery-items/<id:pk>/resume", api.RecoveryResumeView.as_view(), name="resume"),
    path("api/v1/recovery-items/<id:pk>/compensate", api.RecoveryCompensateView.as_view(), name="compensate"),
    path("api/v1/recovery-items/<id:pk>/close", api.RecoveryCloseView.as_view(), name="close"),
    path("api/v1/runs/<id:run_id>/trail", api.RunTrailView.as_view(), name="run-trail"),
    path("metrics", api.MetricsView.as_view(), name="metrics"),
]
