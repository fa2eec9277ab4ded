from django.urls import path

from approvals import views

app_name = "approvals"

urlpatterns = [
    path("", views.inbox, name="inbox"),
    path("<int:pk>/", views.request_detail, name="detail"),
    path("<int:pk>/decide/", views.request_decide, name="decide"),
]
