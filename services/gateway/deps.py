"""FastAPI dependencies for the management API: the gateway state, a DB session, the signed-in user and roles."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from services.common.errors import AuthenticationError, PermissionDeniedError
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


def require_roles(*roles: str) -> Callable[[SessionPrincipal], SessionPrincipal]:
    def check(user: CurrentUser) -> SessionPrincipal:
        if user.role not in roles:
            raise PermissionDeniedError(f"This needs one of the roles: {', '.join(roles)}.", code="role_required")
        return user

    return check


TenantUser = Annotated[SessionPrincipal, Depends(require_roles("tenant_member", "tenant_admin"))]
TenantAdmin = Annotated[SessionPrincipal, Depends(require_roles("tenant_admin"))]
PlatformAdmin = Annotated[SessionPrincipal, Depends(require_roles("platform_admin"))]
FinanceUser = Annotated[SessionPrincipal, Depends(require_roles("finance", "platform_admin"))]
