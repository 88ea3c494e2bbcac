"""Saying on stderr that Numba compiles, when it compiles a generated package's kernels for the
first time: for a real model that is 30-40 s in which the command would otherwise sit silent.

Numba compiles a cached function when its cache holds no code for it, and then only; it announces
each compile as a "numba:compile" event, which `CompileNotice` listens to. "First use" is decided
per source file, the first time one of its functions compiles in the process: whether Numba's
cache held no index (.nbi) for that file then (`pyml.cache.numba_folder` says where Numba files
them). A file whose functions are cached but compile for new argument types (float64 after
float32) says nothing, nor does a function Numba does not cache, which compiles in every process.

On a terminal the line shows the seconds spent compiling so far while Numba compiles, and is
cleared as soon as it stops (the command's own output follows); elsewhere it is written once.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from numba.core import caching, event

from pyml.cache import numba_folder

MANIFEST = "MANIFEST.json"  # what marks the folder of a generated package (gen/<name>/)
REFRESH_SECONDS = 0.5


def is_cold(source_file: Path) -> bool:
    """Whether Numba's cache holds no compiled code of `source_file`'s functions."""
    return not any(numba_folder(source_file.parent).glob(f"{source_file.stem}.*.nbi"))


def what_compiles(source_file: Path) -> str:
    """"kernels for <spec>" for a generated package's file, else "pyml's kernels" (the shared
    ones of pyml/package/, or whatever else Numba caches)."""
    folder = source_file.parent
    return f"kernels for {folder.name}" if (folder / MANIFEST).is_file() else "pyml's kernels"


class CompileNotice(event.Listener):
    def __init__(self):
        self.depth = 0  # nested compiles: a function compiles the functions it calls
        self.cold: dict[Path, bool] = {}  # source file -> cold when it first compiled here
        self.written: set[str] = set()  # the lines written once (not on a terminal)
        self.since: dict[str, float] = {}  # line -> when its first compile began (on a terminal)
        self.shown: str | None = None  # the line on the terminal now
        self.lock = threading.Lock()
        self.ticker: threading.Thread | None = None

    @property
    def stream(self):
        return sys.stderr  # whatever it is when Numba compiles

    def line(self, dispatcher) -> str | None:
        """What to say as `dispatcher` compiles, or None when its compile is no first use."""
        if isinstance(getattr(dispatcher, "_cache", None), caching.NullCache):
            return None  # not cached: compiles in every process
        source = Path(dispatcher.py_func.__code__.co_filename)
        if source not in self.cold:
            self.cold[source] = is_cold(source)
        return f"compiling {what_compiles(source)} (first use)..." if self.cold[source] else None

    def on_start(self, compile_event) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        line = self.line(compile_event.data["dispatcher"])
        if line is None:
            return
        if not self.stream.isatty():
            if line not in self.written:
                self.written.add(line)
                print(line, file=self.stream, flush=True)
            return
        with self.lock:
            self.since.setdefault(line, time.monotonic())
            self.shown = line
            self.draw()
        if self.ticker is None:
            self.ticker = threading.Thread(target=self.tick, name="pyml-compile-notice",
                                           daemon=True)
            self.ticker.start()

    def on_end(self, compile_event) -> None:
        self.depth -= 1
        if self.depth == 0 and self.shown is not None:
            with self.lock:
                self.shown = None
                self.stream.write("\r\033[K")
                self.stream.flush()

    def draw(self) -> None:
        seconds = time.monotonic() - self.since[self.shown]
        self.stream.write(f"\r{self.shown} {seconds:.0f} s\033[K")
        self.stream.flush()

    def tick(self) -> None:
        while True:
            time.sleep(REFRESH_SECONDS)
            with self.lock:
                if self.shown is not None:
                    self.draw()


event.register("numba:compile", CompileNotice())
