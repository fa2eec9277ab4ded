"""The project's URLs, plus POST /bench/noop: the API's authentication and nothing else."""
from django.urls import path

from bench.views import NoopView
from config.urls import urlpatterns as project

urlpatterns = [path("bench/noop", NoopView.as_view(), name="bench-noop"), *project]
