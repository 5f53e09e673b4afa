"""ASGI entry point for multi-worker servers: `uvicorn services.gateway.main:app`."""
from services.common.gc_tuning import service_process
from services.common.settings import get_settings
from services.gateway.app import create_app

service_process()  # a uvicorn worker: this process is the gateway
app = create_app(get_settings())
