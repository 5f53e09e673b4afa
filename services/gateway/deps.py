"""FastAPI dependencies for the management API: the gateway state, a DB session, the signed-in user and roles."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from services.common.errors import AuthenticationError, PermissionDeniedError
from services.common.keys import SCOPE_ADAPTERS_WRITE, SCOPE_USAGE_READ
from services.gateway.auth import CSRF_HEADER, SESSION_COOKIE, SessionPrincipal, check_csrf, load_session
from services.gateway.state import Gateway

_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def get_db(gw: GatewayDep) -> Iterator[Session]:
    with gw.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]


def current_user(request: Request, gw: GatewayDep, db: SessionDep) -> SessionPrincipal:
    """The signed-in user from the session cookie; state-changing calls must carry the CSRF token."""
    loaded = load_session(db, request.cookies.get(SESSION_COOKIE), gw.settings.secret())
    if loaded is None:
        raise AuthenticationError("Sign in first.", code="not_signed_in")
    principal, csrf = loaded
    if request.method not in _SAFE_METHODS:
        check_csrf(csrf, request.headers.get(CSRF_HEADER))
    return principal


CurrentUser = Annotated[SessionPrincipal, Depends(current_user)]


def _check_role(user: SessionPrincipal, roles: tuple[str, ...]) -> SessionPrincipal:
    if user.role not in roles:
        raise PermissionDeniedError(f"This needs one of the roles: {', '.join(roles)}.", code="role_required")
    return user


def require_roles(*roles: str) -> Callable[[SessionPrincipal], SessionPrincipal]:
    def check(user: CurrentUser) -> SessionPrincipal:
        return _check_role(user, roles)

    return check


def session_or_key(scope: str, *roles: str):
    """A signed-in user with one of `roles`, or -- sent as `Authorization: Bearer mpx_...` -- an API key with
    `scope`, acting for its own tenant (scripts and CI: no session, no CSRF, since a header is not ambient
    authority the way a cookie is)."""

    async def check(request: Request, gw: GatewayDep, db: SessionDep) -> SessionPrincipal:
        authorization = request.headers.get("authorization")
        if authorization is None:
            return _check_role(await run_in_threadpool(current_user, request, gw, db), roles)
        key = await gw.key_auth.authenticate(authorization)
        if scope not in key.scopes:
            raise PermissionDeniedError(f"This API key does not have the scope {scope}.", code="missing_scope")
        return SessionPrincipal.of_key(key)

    return check


TenantUser = Annotated[SessionPrincipal, Depends(require_roles("tenant_member", "tenant_admin"))]
TenantAdmin = Annotated[SessionPrincipal, Depends(require_roles("tenant_admin"))]
PlatformAdmin = Annotated[SessionPrincipal, Depends(require_roles("platform_admin"))]
FinanceUser = Annotated[SessionPrincipal, Depends(require_roles("finance", "platform_admin"))]
# Routes a key scope opens as well as a session (services.common.keys; docs/api.md, "API keys").
UsageReader = Annotated[SessionPrincipal, Depends(session_or_key(SCOPE_USAGE_READ, "tenant_member", "tenant_admin"))]
AdapterWriter = Annotated[SessionPrincipal, Depends(session_or_key(SCOPE_ADAPTERS_WRITE, "tenant_admin"))]
