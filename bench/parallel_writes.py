"""`python -m bench.parallel_writes`: the gateway's fan-out writes alone, by helper threads.

Opens N loopback TCP connections (default 9,000: two descriptors each, under the usual
20,000 limit), then writes one 140-byte SSE chunk to every one of them with
`services.gateway.parallel_write.ParallelWriter` at 0, 1, ... helper threads, several rounds
each, and prints the wall time per round and per write. The peers are read by a child
process (`--reader process`, default: as a listener on the same machine would) or not at all
(`--reader none`: the kernel's send path alone). No service runs: this is the piece of a
fan-out round that `LOOPLINE_FANOUT_WRITE_THREADS` parallelizes (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import socket
import statistics
import sys
import time

from services.gateway.parallel_write import ParallelWriter

CHUNK = b"8a\r\n" + b"data: " + b"x" * 130 + b"\n\n\r\n"


def _pairs(count: int) -> tuple[list[socket.socket], list[socket.socket]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4096)
    ours, peers = [], []
    for _ in range(count):
        peer = socket.create_connection(server.getsockname())
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        ours.append(sock)
        peers.append(peer)
    server.close()
    return ours, peers


def _read_forever(peers: list[socket.socket]) -> None:
    selector = selectors.EpollSelector()
    for peer in peers:
        peer.setblocking(False)
        selector.register(peer, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            try:
                if not key.fileobj.recv(65536):  # type: ignore[union-attr]
                    os._exit(0)
            except BlockingIOError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.parallel_writes", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--connections", type=int, default=9000)
    parser.add_argument(
        "--threads", default="", help="comma-separated helper thread counts (default 0..cores-1)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reader", choices=("process", "none"), default="process")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if 2 * args.connections + 64 > hard:
        parser.error(
            f"{args.connections} connections need {2 * args.connections + 64} descriptors; "
            f"the limit is {hard}"
        )
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    levels = [int(x) for x in args.threads.split(",") if x] or list(range(cores))
    ours, peers = _pairs(args.connections)
    if args.reader == "process":
        if os.fork() == 0:
            for sock in ours:
                sock.close()
            _read_forever(peers)
    for peer in peers:
        if args.reader == "process":
            peer.close()
    items = [(sock.fileno(), CHUNK) for sock in ours]
    print(
        f"{args.connections} connections, {len(CHUNK)}-byte chunk, reader {args.reader}, "
        f"{cores} cores"
    )
    for threads in levels:
        writer = ParallelWriter(threads, min_batch=1)
        walls = []
        for _ in range(args.rounds):
            time.sleep(0.2)
            started = time.perf_counter()
            short = writer.write(items)
            walls.append(time.perf_counter() - started)
            if short:
                print(
                    f"  {len(short)} writes short (full buffers): raise the interval or read them",
                    file=sys.stderr,
                )
        writer.close()
        median = statistics.median(walls)
        print(
            f"  {threads} helper thread(s): median {median * 1000:.1f} ms per round, "
            f"{median / args.connections * 1e6:.2f} µs per write "
            f"(min {min(walls) * 1000:.1f}, max {max(walls) * 1000:.1f} ms)"
        )
    for sock in ours:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
