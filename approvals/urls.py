from django.urls import path

from approvals import views

app_name = "approvals"

urlpatterns = [
    path("<int:pk>/", views.request_detail, name="detail"),
]
