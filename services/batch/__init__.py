"""The Batch API's execution: Celery tasks that run tenants' batches on the engines' `batch` priority class,
paced by the engines' load, checkpointed line by line in Postgres (exactly once, with the ledger)."""
