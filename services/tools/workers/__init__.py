"""Integration workers: third-party integration code run in supervised processes outside the
tools service (`pool.WorkerPool`), each holding its outbound connections to the outbound policy
at the socket (`worker_main.py`)."""
