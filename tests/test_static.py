"""The pages' CSS and htmx and the API docs' Swagger UI load under any server, with DEBUG off: `make demo`
(runserver, DEBUG off) once served every page unstyled and without htmx."""
import pytest
from django.conf import settings


@pytest.mark.parametrize("path, kind", [
    ("unwind/unwind.css", "text/css"),
    ("unwind/htmx.min.js", "javascript"),
    ("drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css", "text/css"),
])
def test_static_files_are_served_by_the_app_itself(client, path, kind):
    assert not settings.DEBUG
    response = client.get(f"{settings.STATIC_URL}{path}")
    assert response.status_code == 200, (path, response.status_code)
    assert kind in response["Content-Type"]
    assert b"".join(response.streaming_content if response.streaming else [response.content])
