"""ASGI entry point for multi-worker servers: `uvicorn services.gateway.main:app`."""
from services.common.settings import get_settings
from services.gateway.app import create_app

app = create_app(get_settings())
