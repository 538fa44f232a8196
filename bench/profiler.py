"""`--profile DIR`: py-spy records of every service while each workload runs."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

from bench.deploy import Deployment


class Profiler:
    """`py-spy record --gil` of every service while a workload runs (--profile DIR).

    `--gil` samples the thread holding the GIL: the Python CPU of each process."""

    def __init__(self, dep: Deployment, folder: pathlib.Path | None) -> None:
        self.dep, self.folder = dep, folder
        self.exe = pathlib.Path(sys.executable).with_name("py-spy")
        self.workload = ""
        self.procs: list[asyncio.subprocess.Process] = []

    def __call__(self, workload: str) -> Profiler:
        self.workload = workload
        return self

    async def __aenter__(self) -> None:
        self.procs = []
        if self.folder is None:
            return
        if not self.exe.exists():
            raise RuntimeError(f"--profile needs py-spy: {sys.executable} -m pip install py-spy")
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, pid in self.dep.pids.items():
            out = self.folder / f"{self.workload}-{name}.txt"
            self.procs.append(
                await asyncio.create_subprocess_exec(
                    str(self.exe),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "250",
                    "--gil",
                    "--format",
                    "raw",
                    "-o",
                    str(out),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        await asyncio.sleep(1.0)

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.send_signal(2)
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
