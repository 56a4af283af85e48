"""Who may call what: one :func:`authorize` for every kind of access, one admin-key check.

Each path has an :class:`~gateway.wire.routes.Access`, the route table's
(:func:`gateway.wire.routes.access_of`; both names are re-exported here):

* ``open``: the probes (``/health``, ``/ready``); never a key.
* ``tenant``: the API routes; a tenant's key when tenants are configured
  (:meth:`gateway.admission.tenants.Tenants.authenticate`), else anyone.
* ``scrape``: ``/metrics``; the admin key when ``server.admin_key`` is set, unless
  ``server.metrics_public``.
* ``admin``: ``/admin/...``; the admin key, and without one configured the routes do not
  exist (404).
* ``status``: the status page (``/status``, ``/status.json``); the admin key when one is
  set, as a bearer key or as the password of HTTP Basic (a browser asks for it).

The edge (:func:`authenticate`, run by
:class:`~gateway.http.middleware.RequestAccounting` before the body is read) checks
``tenant`` and ``scrape``; the ``admin`` and ``status`` endpoints check their own access
once routed (so a wrong method on them is a 405 first), never with a tenant's key.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request

from gateway.admission.tenants import admin_key_matches, key_of
from gateway.errors import RouteNotFound, Unauthorized
from gateway.fleet.state import GatewayState
from gateway.observe.record import record_of
from gateway.wire import routes
from gateway.wire.routes import Access, access_of

__all__ = ["REALM", "STATUS_PATHS", "Access", "access_of", "admin_authorized",
           "authenticate", "authorize", "status_authorized"]

STATUS_PATHS = routes.STATUS_PATHS
REALM = "llm-gateway"  # the HTTP Basic realm a browser shows when it asks for the key


def authenticate(scope: Any) -> None:
    """The edge's check, before the request's body is read (the
    :class:`~gateway.http.middleware.RequestAccounting` hook): ``tenant`` and ``scrape``
    access (:func:`authorize`); the admin routes and the status page pass here and are
    checked by their endpoints. The app's state is ``scope["app"].state.gateway``."""
    access = access_of(scope["path"])
    if access in (Access.tenant, Access.scrape):
        authorize(scope["app"].state.gateway, scope, access)


def authorize(state: GatewayState, scope: Any, access: Access) -> None:
    """Let the request of ``scope`` through for ``access``, or raise. A tenant found is
    kept in the request's record (``tenant``, ``priority``:
    :class:`~gateway.observe.record.AccessRecord`).

    :raises Unauthorized: the key needed is missing or wrong (401; for ``status``, with
        the ``WWW-Authenticate: Basic`` challenge a browser answers).
    :raises RouteNotFound: ``admin`` access without ``server.admin_key`` (404: the admin
        routes exist only with a key).
    """
    if access is Access.open:
        return
    server = state.settings.server
    key = None if server.admin_key is None else server.admin_key.get_secret_value()
    headers = scope["headers"]
    if access is Access.tenant:
        tenant = state.tenants.authenticate(headers)
        record = record_of(scope)
        record.tenant, record.priority = tenant, tenant.priority
    elif access is Access.scrape:
        if key is not None and not server.metrics_public and not admin_authorized(
                headers, key):
            raise Unauthorized("/metrics (server.admin_key is set) needs Authorization: "
                               "Bearer <admin_key>.")
    elif access is Access.admin:
        if key is None:
            path = Request(scope).url.path  # as the router's own 404 spells it
            raise RouteNotFound(f"{scope['method']} {path}: Not Found (the "
                                "admin routes exist when server.admin_key is set).")
        if not admin_authorized(headers, key):
            raise Unauthorized("The admin routes need Authorization: Bearer <admin_key>.")
    elif key is not None and not admin_authorized(headers, key, basic=True):
        raise Unauthorized("The status page needs server.admin_key: send it as "
                           "Authorization: Bearer <admin_key>, or as the password of "
                           "HTTP Basic authentication (any user name).",
                           challenge=f'Basic realm="{REALM}", charset="UTF-8"')


def admin_authorized(headers: Iterable[tuple[bytes, bytes]], admin_key: str, *,
                     basic: bool = False) -> bool:
    """The one admin-key check: True when the request carries ``admin_key`` as
    ``Authorization: Bearer <key>``, or with ``basic`` also as the password of HTTP
    Basic (:func:`status_authorized`). Keys are compared in constant time
    (:func:`gateway.admission.tenants.admin_key_matches`)."""
    if basic:
        return status_authorized(headers, admin_key)
    try:
        given = key_of((k, v) for k, v in headers if k.lower() == b"authorization")
    except Unauthorized:
        given = None
    return given is not None and admin_key_matches(given, admin_key)


def status_authorized(headers: Iterable[tuple[bytes, bytes]], admin_key: str) -> bool:
    """True when the request carries the admin key, as ``Authorization: Bearer <key>``
    (scripts, like the ``/admin`` routes) or as HTTP Basic with the key as the password
    and any user name (browsers: they ask for it after a 401 with ``WWW-Authenticate:
    Basic``). Tenants' keys, ``x-api-key`` and two ``Authorization`` headers are not
    accepted. Keys are compared in constant time."""
    auths = [v for k, v in headers if k.lower() == b"authorization"]
    if len(auths) != 1:
        return False
    # bytes kept as sent (UTF-8 or not), as tenants.key_of reads a bearer key
    scheme, _, rest = auths[0].decode("utf-8", "surrogateescape").strip().partition(" ")
    if scheme.lower() == "bearer":
        given = rest.strip()
    elif scheme.lower() == "basic":
        try:  # ValueError: not base64 (binascii.Error), not ASCII, or not UTF-8 inside
            decoded = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
        except ValueError:
            return False
        _user, colon, given = decoded.partition(":")
        if not colon:
            return False
    else:
        return False
    return bool(given) and admin_key_matches(given, admin_key)
