"""The command side of `shard-check`: run the request in a fresh device process (JAX fixes its devices when it
starts) and read its report back. No JAX here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

from .. import errors
from ..errors import DeviceError, InternalError, JaxUnavailableError, RngauditError
from ..output.shard_json import from_json
from .report import ShardReport
from .request import ShardRequest, request_json

_WORKER = "rngaudit.shard.worker"


def child_env(r: ShardRequest, base: dict | None = None) -> dict:
    """The device process's environment: forced CPU devices must be set before JAX starts."""
    env = dict(os.environ if base is None else base)
    if r.devices is not None:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={r.devices}"])
        env["JAX_NUM_CPU_DEVICES"] = str(r.devices)
        env["JAX_PLATFORMS"] = "cpu"
    if r.processes > 1:
        env["JAX_PLATFORMS"] = "cpu"  # local processes share this machine's CPU, never one accelerator
    # the child must import this rngaudit even when it is run from a checkout that is not installed
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
    return env


def _signal(proc: subprocess.Popen) -> None:
    """Kill the device process and anything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    """Stop the device process and reap it."""
    _signal(proc)
    proc.communicate()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def _error(kind: str, message: str) -> RngauditError:
    """The error the device process reported, as the class it named (its own bugs are InternalError)."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, RngauditError)) or cls is errors.FlaxError:
        cls = InternalError if kind == "internal" else RngauditError
    return cls(message)


class Terminated(SystemExit):
    """SIGTERM's way out (the command's error boundary lets it through, as it does no user's sys.exit)."""


@contextlib.contextmanager
def _terminated_as_exit():
    """SIGTERM (a CI job cancelled, `kill`) ends the command as an exception would: the device processes are
    killed and the temporary folder removed on the way out, then it exits 143."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(args: list[str], env: dict) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            [sys.executable, "-m", _WORKER, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        raise DeviceError(f"cannot start the device process ({e.strerror or e})") from None


class _Results:
    """The result files of the device processes, each read once, when it appears (a worker writes it whole, with
    os.replace)."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.read: dict[int, dict] = {}

    def get(self, i: int) -> dict | None:
        if i not in self.read and os.path.exists(self.paths[i]):
            with open(self.paths[i], encoding="utf-8") as f:
                self.read[i] = json.load(f)
        return self.read.get(i)

    def failed(self, i: int) -> bool:
        return "error" in (self.get(i) or {})


def _wait(procs: list[subprocess.Popen], results: _Results, timeout: float, many: bool) -> tuple[list[str], list]:
    """(every process's stderr, the processes killed at the deadline) once all have ended. Past `timeout` they are
    all killed (no hang, no orphan); with several processes, so are the others as soon as one has reported an
    error or died without a result (they may wait for it in a collective, or in jax.distributed's shutdown
    barrier, until the deadline)."""
    import threading
    import time

    def crashed(i: int) -> bool:  # ended by itself without a result (killed by the system, os._exit)
        return not threads[i].is_alive() and results.get(i) is None

    errs: list[bytes] = [b""] * len(procs)

    def drain(i: int) -> None:
        _, errs[i] = procs[i].communicate()

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            threads[[t.is_alive() for t in threads].index(True)].join(0.05)
            if many and any(results.failed(i) or crashed(i) for i in range(len(procs))):
                break
        late = [i for i, t in enumerate(threads) if t.is_alive()]
    except BaseException:
        for p in procs:
            _signal(p)
        raise
    for i in late:
        _signal(procs[i])  # (its drain thread reaps it)
    for t in threads:
        t.join()
    return [e.decode("utf-8", "replace") for e in errs], late


def _read(proc: subprocess.Popen, result: dict | None, err_text: str, who: str) -> dict:
    if result is None:
        how = (
            f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with code {proc.returncode}"
        )
        last = _last_line(err_text)
        raise DeviceError(f"{who} {how} before reporting" + (f": {last}" if last else ""))
    if "error" in result:
        raise _error(result["error"]["kind"], result["error"]["message"])
    return result


def run(r: ShardRequest) -> ShardReport:
    """Run the checks in a fresh process started with the devices asked for (with --processes, that many
    processes joined through jax.distributed); raise RngauditError when it cannot (bad input it finds, devices
    that cannot be had, a function that fails, a process that does not join, a timeout)."""
    import dataclasses
    import importlib.util

    from .step_analysis import analyse

    if importlib.util.find_spec("jax") is None:  # (the device process runs JAX: say so before starting it)
        raise JaxUnavailableError()
    many = r.processes > 1
    with _terminated_as_exit(), tempfile.TemporaryDirectory(prefix="rngaudit-shard-") as tmp:
        req_path = os.path.join(tmp, "request.json")
        with open(req_path, "w", encoding="utf-8") as f:
            json.dump(request_json(r), f)
        env = child_env(r)
        paths = [os.path.join(tmp, f"result{i}.json") for i in range(r.processes)]
        results = _Results(paths)
        procs: list[subprocess.Popen] = []
        try:
            if many:
                coordinator = f"127.0.0.1:{_free_port()}"
                for i in range(r.processes):
                    procs.append(_start([req_path, paths[i], str(i), coordinator], env))
            else:
                procs.append(_start([req_path, paths[0]], env))
        except BaseException:
            for p in procs:
                _kill(p)
            raise
        errs, late = _wait(procs, results, r.timeout, many)
        if os.environ.get("RNGAUDIT_DEBUG"):
            for e in errs:
                sys.stderr.write(e)
        failed = [i for i in range(len(procs)) if results.failed(i)]
        died = [i for i in range(len(procs)) if i not in late and results.get(i) is None]
        if late and not failed and not died:
            # a process that reported may still wait at exit for the others (jax.distributed's shutdown barrier)
            silent = [i for i in late if results.get(i) is None] or late
            if many:
                raise DeviceError(
                    f"the {len(procs)} processes did not finish within {r.timeout:g} s (--timeout "
                    f"{r.timeout:g}); process(es) {', '.join(map(str, silent))} had not reported (a process that "
                    "does not join jax.distributed, or a step that waits for another process)"
                )
            raise DeviceError(
                f"the device run did not finish within {r.timeout:g} s (--timeout {r.timeout:g}); "
                "the devices may be unavailable or busy, or the checks need longer"
            )
        out = []
        # what went wrong first explains the rest: a process that reported an error, then one that died without
        # a result, then the others (killed by us, or ended waiting for it)
        order = failed + died + [i for i in range(len(procs)) if i not in failed and i not in died]
        for i in order:
            try:
                out.append(_read(procs[i], results.get(i), errs[i], f"process {i}" if many else "the device process"))
            except RngauditError as e:
                if many and not str(e).startswith("process "):
                    raise type(e)(f"process {i}: {e}") from None
                raise
    out.sort(key=lambda o: o["process"])
    report = from_json(out[0]["report"])
    steps = [
        analyse([o["steps"][j] for o in out], r.data_axes, report.mesh.names, r.processes)
        for j in range(len(out[0]["steps"]))
    ]
    return dataclasses.replace(report, targets=report.targets + tuple(steps))
