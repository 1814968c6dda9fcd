"""The command side of `shard-check`: run the request in a fresh device process (JAX fixes its devices when it
starts) and read its report back. No JAX here."""

from __future__ import annotations

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
    # the child must import this rngaudit even when it is run from a checkout that is not installed
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Stop the device process and anything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
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


def run(r: ShardRequest) -> ShardReport:
    """Run the checks in a fresh process started with the devices asked for; raise RngauditError when it
    cannot (bad input it finds, devices that cannot be had, a function that fails, a timeout)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:  # (the device process runs JAX: say so before starting it)
        raise JaxUnavailableError()
    with tempfile.TemporaryDirectory(prefix="rngaudit-shard-") as tmp:
        req_path, res_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req_path, "w", encoding="utf-8") as f:
            json.dump(request_json(r), f)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", _WORKER, req_path, res_path],
                env=child_env(r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise DeviceError(f"cannot start the device process ({e.strerror or e})") from None
        try:
            _, err = proc.communicate(timeout=r.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise DeviceError(
                f"the device run did not finish within {r.timeout:g} s (--timeout {r.timeout:g}); "
                "the devices may be unavailable or busy, or the checks need longer"
            ) from None
        except BaseException:
            _kill(proc)
            raise
        err_text = err.decode("utf-8", "replace")
        if os.environ.get("RNGAUDIT_DEBUG"):
            sys.stderr.write(err_text)
        if not os.path.exists(res_path):
            how = (
                f"was killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exited with code {proc.returncode}"
            )
            last = _last_line(err_text)
            raise DeviceError(f"the device process {how} before reporting" + (f": {last}" if last else ""))
        with open(res_path, encoding="utf-8") as f:
            result = json.load(f)
    if "error" in result:
        raise _error(result["error"]["kind"], result["error"]["message"])
    return from_json(result["report"])
