"""The runner lock: one runner per batch, and a finished (or failed) run gives it back at once, so Celery's
retry of that same run resumes the batch instead of finding it "running elsewhere"."""
from __future__ import annotations

from services.batch import checkpoint
from services.batch.runner import _release
from services.common.ids import uuid7


def test_a_run_that_ends_gives_its_runner_lock_back_to_the_next_run(db_engine):
    batch_id = uuid7()
    first, second = db_engine.connect(), db_engine.connect()
    try:
        assert checkpoint.try_lock(first, batch_id)
        assert not checkpoint.try_lock(second, batch_id)  # one runner per batch
        _release(first, batch_id)  # the run ends (its connection goes back to the pool)
        assert checkpoint.try_lock(second, batch_id)  # the retry takes over
    finally:
        checkpoint.unlock(second, batch_id)
        second.close()


def test_a_broken_lock_connection_is_dropped_and_the_lock_goes_with_it(db_engine):
    batch_id = uuid7()
    first, second = db_engine.connect(), db_engine.connect()
    try:
        assert checkpoint.try_lock(first, batch_id)
        first.connection.dbapi_connection.pgconn.finish()  # the server session is gone under the pool's feet
        _release(first, batch_id)
        assert checkpoint.try_lock(second, batch_id)
    finally:
        checkpoint.unlock(second, batch_id)
        second.close()
