"""Tool requests are signed for their tenant; a forged, altered, re-targeted or stale one is not accepted."""
from ledger.executors import signing


def _headers(**overrides):
    headers = signing.sign(tenant="acme", method="POST", url="http://tools.test/crm/tickets?x=1", body=b'{"a":1}',
                           now=1_000_000)
    headers.update(overrides)
    return headers


def test_a_signed_request_names_its_tenant():
    assert signing.verify(headers=_headers(), method="POST", path="/crm/tickets?x=1", body=b'{"a":1}',
                          now=1_000_010) == "acme"


def test_a_request_claiming_another_tenant_is_refused():
    assert signing.verify(headers=_headers(**{"Unwind-Tenant": "globex"}), method="POST", path="/crm/tickets?x=1",
                          body=b'{"a":1}', now=1_000_010) is None


def test_an_altered_body_path_or_method_is_refused():
    for method, path, body in (("POST", "/crm/tickets?x=1", b'{"a":2}'), ("POST", "/crm/tickets?x=2", b'{"a":1}'),
                               ("PUT", "/crm/tickets?x=1", b'{"a":1}')):
        assert signing.verify(headers=_headers(), method=method, path=path, body=body, now=1_000_010) is None


def test_a_stale_or_unsigned_request_is_refused():
    assert signing.verify(headers=_headers(), method="POST", path="/crm/tickets?x=1", body=b'{"a":1}',
                          now=1_000_000 + signing.MAX_AGE_SECONDS + 1) is None
    assert signing.verify(headers={}, method="POST", path="/", body=b"", now=1_000_000) is None
