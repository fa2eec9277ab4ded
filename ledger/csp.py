"""The Content-Security-Policy header (django-csp), built once per settings instead of twice per response.

django-csp builds the header from CONTENT_SECURITY_POLICY on every response, and the report-only one too: 40 µs of
the 400 µs of CPU a small API answer costs in process. Most responses (every API answer) use neither a nonce nor a
view's `@csp_update`/`@csp_replace`/`@csp` decorator, so their header is the same string each time: that string is
built once and kept until a setting it is made from changes (the `setting_changed` signal, which tests send). A
response that uses a nonce or a decorator goes through django-csp's own code, unchanged.
"""
from __future__ import annotations

import http.client
from functools import lru_cache

from csp.constants import HEADER, HEADER_REPORT_ONLY
from csp.middleware import CheckableLazyObject
from csp.middleware import CSPMiddleware as DjangoCSPMiddleware
from csp.utils import build_policy
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

# What a view's decorators set on its response: any of them means the policy is that response's own.
PER_RESPONSE = ("_csp_config", "_csp_update", "_csp_replace", "_csp_config_ro", "_csp_update_ro", "_csp_replace_ro")
SETTINGS = ("CONTENT_SECURITY_POLICY", "CONTENT_SECURITY_POLICY_REPORT_ONLY")
DEBUG_EXEMPT = (http.client.INTERNAL_SERVER_ERROR, http.client.NOT_FOUND)


@lru_cache(maxsize=1)
def settings_policies() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(header, policy, excluded path prefixes) for the policy and the report-only one, from the settings alone."""
    found = []
    for header, setting, report_only in ((HEADER, SETTINGS[0], False), (HEADER_REPORT_ONLY, SETTINGS[1], True)):
        policy = build_policy(report_only=report_only)
        prefixes = tuple((getattr(settings, setting, None) or {}).get("EXCLUDE_URL_PREFIXES", None) or ())
        found.append((header, policy, prefixes))
    return tuple(found)


@receiver(setting_changed)
def _forget_policies(*, setting, **kwargs) -> None:
    if setting in SETTINGS:
        settings_policies.cache_clear()


class CSPMiddleware(DjangoCSPMiddleware):
    def process_response(self, request, response):
        if getattr(request, "_csp_nonce", None) is not None \
                or any(getattr(response, name, None) is not None for name in PER_RESPONSE):
            return super().process_response(request, response)
        if response.status_code in DEBUG_EXEMPT and settings.DEBUG:
            return response
        exempt = (getattr(response, "_csp_exempt", False), getattr(response, "_csp_exempt_ro", False))
        for (header, policy, prefixes), is_exempt in zip(settings_policies(), exempt):
            if policy and header not in response and is_exempt is False \
                    and not request.path_info.startswith(prefixes):
                response[header] = policy
        # As django-csp: a nonce asked for after the header was written would be in no header, so it raises.
        setattr(request, "csp_nonce", CheckableLazyObject(self._csp_nonce_post_response))
        return response
