"""The adapter lifecycle: uploads, content-addressed storage, validation, the quality gate on Celery,
promotion to routable, and retirement (see docs/api.md and ARCHITECTURE.md "Adapter lifecycle")."""
