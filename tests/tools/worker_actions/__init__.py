"""Test actions run inside integration workers (tests/tools/test_workers.py puts this folder on
the workers' LOOPLINE_WORKER_PATH)."""
