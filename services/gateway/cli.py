"""`mplex gateway ...`: run the gateway."""
from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, help="The tenant-aware gateway.")


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "info") -> None:
    """Serve the OpenAI API, the management API and the web app."""
    import uvicorn

    from services.common.gc_tuning import service_process
    from services.common.http_limits import http_protocol
    from services.common.logging import configure
    from services.common.settings import get_settings
    from services.gateway.app import create_app

    service_process()
    log_config = configure("gateway", log_level)
    settings = get_settings()
    server = dict(host=host, port=port, log_level=log_level, log_config=log_config,
                  http=http_protocol(settings.max_header_bytes))
    if workers > 1:
        uvicorn.run("services.gateway.main:app", workers=workers, **server)
    else:
        uvicorn.run(create_app(settings), **server)
