from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from recovery.views import home

from mcp_gateway.views import mcp_endpoint

urlpatterns = [
    path("", home, name="home"),
    # Browsers ask for /favicon.ico wherever a page names no icon (Django's admin): the one the pages name.
    path("favicon.ico", RedirectView.as_view(url=static("unwind/favicon.svg"), permanent=True)),
    path("admin/", admin.site.urls),
    path("mcp", mcp_endpoint, name="mcp"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("approvals.link_urls")),
    path("approvals/", include("approvals.urls")),
    path("console/", include("recovery.urls")),
    path("", include("ledger.urls")),
    path("", include("approvals.api_urls")),
    path("", include("recovery.api_urls")),
]

if settings.UNWIND_SANDBOX:
    urlpatterns.insert(0, path("sandbox/", include("sandbox.urls")))

handler404 = "ledger.api.problems.not_found"
