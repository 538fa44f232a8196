"""Summarize py-spy collapsed stacks (`bench --profile DIR`): top self and inclusive frames.

.venv/bin/python -m bench.profile_report DIR/latency-billing.txt [--top 25] [--grep services/]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_IDLE = re.compile(
    r"select|epoll|poll \(|_run_once.*\(asyncio|wait \(threading|_worker \(concurrent"
)


def load(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as handle:
        for line in handle:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                stacks.append((stack.split(";"), int(count)))
            except ValueError:
                continue
    return stacks


_FILE = re.compile(r"\(([^():]+)(?::\d+)?\)$")


def package_of(frame: str) -> str:
    """The package of a py-spy frame "fn (path:line)": "sqlalchemy", "services/gateway", ..."""
    match = _FILE.search(frame)
    if not match:
        return frame or "(native/unknown)"
    path = match.group(1)
    if path.startswith("services/"):
        return "/".join(path.split("/")[:2])
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    top = path.split("/", 1)[0]
    return top[:-3] if top.endswith(".py") else top


def by_package(stacks: list[tuple[list[str], int]]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        counts[package_of(frames[-1])] += count
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--grep", default="", help="inclusive table only for frames containing this text"
    )
    args = parser.parse_args(argv)
    stacks = load(args.path)
    total = sum(c for _, c in stacks) or 1
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        own[frames[-1]] += count
        for frame in set(frames):
            incl[frame] += count
    print(f"{args.path}: {total} samples")
    print("\nself (leaf frames):")
    for frame, count in own.most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {frame}")
    print("\nself by package (leaf frame's module):")
    for package, count in by_package(stacks).most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {package}")
    print(f"\ninclusive{' (' + args.grep + ')' if args.grep else ''}:")
    shown = 0
    for frame, count in incl.most_common():
        if args.grep and args.grep not in frame:
            continue
        print(f"  {100 * count / total:5.1f}%  {frame}")
        shown += 1
        if shown >= args.top:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
