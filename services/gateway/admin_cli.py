"""`mplex admin ...`: tenants, users and API keys from a terminal, straight against the platform database
(MPLEX_DATABASE_URL, else the embedded server). The same crud functions as the HTTP API, so the same rules
and audit rows (actor = the OS user, via "cli").
"""
from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import typer

app = typer.Typer(no_args_is_help=True, help="Platform administration: tenants, users, API keys.")
tenant_app = typer.Typer(no_args_is_help=True, help="Create, list, suspend tenants and set their limits.")
user_app = typer.Typer(no_args_is_help=True, help="Web sign-in users.")
key_app = typer.Typer(no_args_is_help=True, help="Tenants' API keys.")
app.add_typer(tenant_app, name="tenant")
app.add_typer(user_app, name="user")
app.add_typer(key_app, name="key")

KEY_CACHE_PREFIX = "kc:"  # services.gateway.auth.KeyAuth's Redis entries, `kc:<sha256 of the key>`
_UNLIMITED = {"none", "null", "unlimited", "-"}

_LIMIT_HELP = "an integer, or 'none' for unlimited"
TokensPerMin = typer.Option(None, "--tokens-per-min", help=_LIMIT_HELP)
RequestsPerMin = typer.Option(None, "--requests-per-min", help=_LIMIT_HELP)
Concurrent = typer.Option(None, "--concurrent", help=_LIMIT_HELP)
MonthlyTokens = typer.Option(None, "--monthly-tokens", help=_LIMIT_HELP)
JsonOut = typer.Option(False, "--json", help="Machine-readable output")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


@contextmanager
def _unit_of_work() -> Iterator:
    """One transaction; a refused action (an ApiError from crud) exits 1 with its message."""
    from services.common.db import session_scope
    from services.common.errors import ApiError

    try:
        with session_scope() as session:
            yield session
    except ApiError as exc:
        raise _fail(exc.message) from None


def _actor():
    from services.common.audit import Actor

    return Actor.cli()


def _parse_limits(**given: str | None) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, raw in given.items():
        if raw is None:
            continue
        if raw.strip().lower() in _UNLIMITED:
            out[name] = None
            continue
        try:
            out[name] = int(raw.replace("_", ""))
        except ValueError:
            raise _fail(f"--{name.replace('_', '-')} must be {_LIMIT_HELP}, not {raw!r}") from None
    return out


def _limits(tokens_per_min, requests_per_min, concurrent, monthly_tokens) -> dict[str, int | None]:
    return _parse_limits(tokens_per_min=tokens_per_min, requests_per_min=requests_per_min,
                         concurrent_requests=concurrent, monthly_token_budget=monthly_tokens)


def forget_cached_keys(key_hashes: list[str]) -> None:
    """Drop keys' cache entries in the gateways' Redis so a change applies now instead of within the key-cache
    TTL. No Redis configured and no embedded one running means no gateway holds a cache to drop."""
    from redis import Redis
    from redis.exceptions import RedisError

    from services.common.settings import get_settings

    if not key_hashes:
        return
    settings = get_settings()
    url = settings.redis_url
    if url is None:
        from services.common.embedded import EmbeddedRedis

        embedded = EmbeddedRedis(settings.state_dir)
        if not embedded.is_running():
            return
        url = embedded.url()
    try:
        with Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3) as client:
            for i in range(0, len(key_hashes), 500):
                client.delete(*(KEY_CACHE_PREFIX + h for h in key_hashes[i:i + 500]))
    except (RedisError, OSError) as exc:
        typer.secho(f"warning: Redis unreachable ({exc.__class__.__name__}); gateways pick the change up within "
                    f"{settings.key_cache_ttl_s:g} s (the key-cache TTL)", err=True, fg=typer.colors.YELLOW)


def _limits_text(limits) -> str:
    from services.gateway.crud import LIMIT_FIELDS

    return ", ".join(f"{f}={'unlimited' if getattr(limits, f, None) is None else getattr(limits, f)}" for f in LIMIT_FIELDS)


def _tenant_dict(t, tokens: int | None = None) -> dict:
    from services.gateway.crud import LIMIT_FIELDS

    d = {"id": str(t.id), "slug": t.slug, "name": t.name, "plan": t.plan, "status": str(t.status),
         "limits": {f: getattr(t.limits, f, None) for f in LIMIT_FIELDS}}
    if tokens is not None:
        d["usage_this_month_tokens"] = tokens
    return d


# -- tenants ----------------------------------------------------------------------------------------------------
@tenant_app.command("create")
def tenant_create(
    slug: str = typer.Argument(..., help="URL-safe id: a-z, 0-9, '-'"),
    name: str = typer.Option(None, "--name", help="Display name (default: the slug)"),
    plan: str = typer.Option("default", "--plan", help="Price plan"),
    tokens_per_min: str = TokensPerMin, requests_per_min: str = RequestsPerMin, concurrent: str = Concurrent,
    monthly_tokens: str = MonthlyTokens, as_json: bool = JsonOut,
) -> None:
    """Create a tenant. A limit not given gets the new-tenant default (printed with the result; see
    docs/gateway.md); 'none' makes it unlimited."""
    from services.gateway import crud

    limits = _limits(tokens_per_min, requests_per_min, concurrent, monthly_tokens)
    with _unit_of_work() as s:
        t = crud.create_tenant(s, name=name or slug, slug=slug, plan=plan, limits=limits, actor=_actor())
        out = _tenant_dict(t)
    typer.echo(json.dumps(out) if as_json else f"created tenant {out['slug']} ({out['id']}): {_limits_text(t.limits)}")


@tenant_app.command("list")
def tenant_list(as_json: bool = JsonOut) -> None:
    """Every tenant with status, plan, limits and tokens used this month."""
    from services.gateway import crud

    with _unit_of_work() as s:
        tenants = crud.list_tenants(s)
        used = crud.tokens_this_month_by_tenant(s)
        rows = [_tenant_dict(t, used.get(t.id, 0)) for t in tenants]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        lim = ", ".join(f"{k}={'-' if v is None else v}" for k, v in r["limits"].items())
        typer.echo(f"{r['slug']:<24} {r['status']:<10} {r['plan']:<10} {r['usage_this_month_tokens']:>12} tok  {r['id']}  {lim}")


def _set_status(ref: str, status: str) -> None:
    from services.common.audit import find_tenant
    from services.gateway import crud

    with _unit_of_work() as s:
        t = find_tenant(s, ref=ref)
        crud.set_status(s, tenant_id=t.id, status=status, actor=_actor())
        hashes = crud.live_key_hashes(s, tenant_id=t.id)
        slug = t.slug
    forget_cached_keys(hashes)
    typer.echo(f"tenant {slug} is {status}")


@tenant_app.command("suspend")
def tenant_suspend(tenant: str = typer.Argument(..., help="Slug or id")) -> None:
    """Suspend a tenant: its API keys stop working (403 tenant_suspended); data and statements stay."""
    _set_status(tenant, "suspended")


@tenant_app.command("activate")
def tenant_activate(tenant: str = typer.Argument(..., help="Slug or id")) -> None:
    """Lift a suspension."""
    _set_status(tenant, "active")


@tenant_app.command("limits")
def tenant_limits(
    tenant: str = typer.Argument(..., help="Slug or id"),
    tokens_per_min: str = TokensPerMin, requests_per_min: str = RequestsPerMin, concurrent: str = Concurrent,
    monthly_tokens: str = MonthlyTokens, as_json: bool = JsonOut,
) -> None:
    """Show a tenant's limits, or change the ones given (others keep their value)."""
    from services.common.audit import find_tenant
    from services.gateway import crud

    limits = _limits(tokens_per_min, requests_per_min, concurrent, monthly_tokens)
    hashes: list[str] = []
    with _unit_of_work() as s:
        t = find_tenant(s, ref=tenant)
        if limits:
            t = crud.set_limits(s, tenant_id=t.id, limits=limits, actor=_actor())
            hashes = crud.live_key_hashes(s, tenant_id=t.id)
        out = _tenant_dict(t)
        text = f"{t.slug}: {_limits_text(t.limits)}"
    forget_cached_keys(hashes)
    typer.echo(json.dumps(out["limits"]) if as_json else text)


# -- users ------------------------------------------------------------------------------------------------------
@user_app.command("create")
def user_create(
    email: str = typer.Argument(...),
    role: str = typer.Option(..., "--role", help="tenant_member | tenant_admin | platform_admin | finance"),
    tenant: str = typer.Option(None, "--tenant", help="Slug or id (tenant roles only)"),
    password: str = typer.Option(..., "--password", prompt=True, hide_input=True, confirmation_prompt=True,
                                 envvar="MPLEX_NEW_USER_PASSWORD", help="Prompted for when not given"),
    as_json: bool = JsonOut,
) -> None:
    """Create a web sign-in user."""
    from services.common.audit import find_tenant
    from services.gateway import crud

    with _unit_of_work() as s:
        tenant_id = find_tenant(s, ref=tenant).id if tenant else None
        u = crud.create_user(s, email=email, password=password, role=role, tenant_id=tenant_id, actor=_actor())
        out = {"id": str(u.id), "email": u.email, "role": str(u.role), "tenant_id": str(tenant_id) if tenant_id else None}
    typer.echo(json.dumps(out) if as_json else f"created {out['role']} {out['email']} ({out['id']})")


# -- keys -------------------------------------------------------------------------------------------------------
@key_app.command("create")
def key_create(
    tenant: str = typer.Option(..., "--tenant", help="Slug or id"),
    name: str = typer.Option(..., "--name"),
    scope: list[str] = typer.Option(None, "--scope", help="Repeatable; default: inference"),
    as_json: bool = JsonOut,
) -> None:
    """Create an API key and print it. It is shown this once: only its hash is stored."""
    from services.common.audit import find_tenant
    from services.gateway import crud

    with _unit_of_work() as s:
        t = find_tenant(s, ref=tenant)
        row, full = crud.create_api_key(s, tenant_id=t.id, name=name, scopes=scope or None, actor=_actor())
        out = {"id": str(row.id), "name": row.name, "prefix": row.prefix, "tenant": t.slug, "key": full}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        typer.secho(f"created key {out['name']} ({out['id']}) for {out['tenant']}; it will not be shown again:", err=True)
        typer.echo(full)  # alone on stdout, so `KEY=$(mplex admin key create ...)` works


@key_app.command("list")
def key_list(tenant: str = typer.Option(..., "--tenant", help="Slug or id"), as_json: bool = JsonOut) -> None:
    """A tenant's keys (prefix, scopes, last use, revocation); never their secrets."""
    from services.common.audit import find_tenant
    from services.gateway import crud

    with _unit_of_work() as s:
        t = find_tenant(s, ref=tenant)
        rows = [{"id": str(k.id), "name": k.name, "prefix": k.prefix, "scopes": list(k.scopes),
                 "created_at": k.created_at.isoformat(),
                 "last_used_at": k.last_used_at.isoformat() if k.last_used_at else None,
                 "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}
                for k in crud.list_api_keys(s, tenant_id=t.id)]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        state = f"revoked {r['revoked_at']}" if r["revoked_at"] else f"last used {r['last_used_at'] or 'never'}"
        typer.echo(f"mpx_{r['prefix']}_…  {r['name']:<24} {','.join(r['scopes']):<28} {state}  {r['id']}")


@key_app.command("revoke")
def key_revoke(key: str = typer.Argument(..., help="The key's id or its public prefix")) -> None:
    """Revoke a key; gateways refuse it at once (its cache entry is dropped)."""
    from sqlalchemy import select

    from services.common.models import ApiKey
    from services.gateway import crud

    with _unit_of_work() as s:
        try:
            cond = ApiKey.id == uuid.UUID(key)
        except ValueError:
            cond = ApiKey.prefix == key.removeprefix("mpx_").split("_")[0]
        row = s.scalar(select(ApiKey).where(cond))
        if row is None:
            raise _fail(f"no API key with id or prefix {key!r}")
        row = crud.revoke_api_key(s, tenant_id=row.tenant_id, key_id=row.id, actor=_actor())
        key_hash, label = row.key_hash, f"{row.name} (mpx_{row.prefix}_…)"
    forget_cached_keys([key_hash])
    typer.echo(f"revoked {label}")


# -- demo -------------------------------------------------------------------------------------------------------
@app.command("seed-demo")
def seed_demo_cmd(
    existing_key: str = typer.Option(None, "--existing-key", envvar="MPLEX_DEMO_API_KEY",
                                     help="Reuse this demo key if still valid (e.g. from the last dev.json)"),
) -> None:
    """Create the demo tenant, its users (known dev passwords) and a demo key; print them as JSON."""
    from services.common.settings import get_settings
    from services.gateway.seed import seed_demo

    if get_settings().env == "prod":
        raise _fail("refusing to seed demo users with published passwords when MPLEX_ENV=prod")
    with _unit_of_work() as s:
        seeded = seed_demo(s, existing_key=existing_key)
    json.dump(seeded.as_dict(), sys.stdout, indent=2)
    sys.stdout.write("\n")
