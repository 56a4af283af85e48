"""Who may call what (gateway.http.auth): the access of each path and the one admin-key
check; the routes' own answers are pinned by test_app, test_status and test_tenants."""

from __future__ import annotations

import base64

import pytest

from gateway.http.auth import Access, access_of, admin_authorized


@pytest.mark.parametrize(("path", "access"), [
    ("/health", Access.open), ("/ready", Access.open),
    ("/status", Access.status), ("/status.json", Access.status),
    ("/admin/backends", Access.admin), ("/admin/reload", Access.admin),
    ("/metrics", Access.scrape),
    ("/v1/chat/completions", Access.tenant), ("/api/tags", Access.tenant),
    ("/admin", Access.tenant),  # not an admin route: the API's 404 after a tenant's key
])
def test_each_path_has_one_access(path: str, access: Access) -> None:
    assert access_of(path) is access


def test_auth_speaks_the_route_tables_access() -> None:
    from gateway.wire import routes

    assert Access is routes.Access and access_of is routes.access_of


def test_the_admin_key_is_a_bearer_key_and_basic_only_where_asked() -> None:
    bearer = [(b"authorization", b"Bearer sesame")]
    basic = [(b"Authorization", b"Basic " + base64.b64encode(b"me:sesame"))]
    assert admin_authorized(bearer, "sesame")
    assert admin_authorized(bearer, "sesame", basic=True)
    assert not admin_authorized(basic, "sesame")
    assert admin_authorized(basic, "sesame", basic=True)
    assert not admin_authorized([(b"authorization", b"Bearer other")], "sesame")
    assert not admin_authorized([(b"x-api-key", b"sesame")], "sesame")
    assert not admin_authorized([(b"authorization", b"Bearer")], "sesame")
    assert not admin_authorized([], "sesame", basic=True)
