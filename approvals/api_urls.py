from django.urls import path

from approvals import api

app_name = "approvals-api"

urlpatterns = [
    path("api/v1/approvals", api.ApprovalListView.as_view(), name="list"),
    path("api/v1/approvals/<id:pk>", api.ApprovalDetailView.as_view(), name="detail"),
    path("api/v1/approvals/<id:pk>/approve", api.ApprovalApproveView.as_view(), name="approve"),
    path("api/v1/approvals/<id:pk>/reject", api.ApprovalRejectView.as_view(), name="reject"),
]
