"""A long report written by two processes (rngaudit.output.halves): derive's jsonl, json and text reports of Linen
and NNX specs are byte for byte what one process writes, across the row where the child takes over (drawn values
load JAX, and nothing forks beside it: these specs draw none); a child that fails, a fork that fails, and a reader that
stops early (the child ended and reaped) all still give the one-process text. In a fresh process: the fork is
refused once JAX is loaded, and this test must see it happen."""

from __future__ import annotations

import os
import subprocess
import sys

from support import COUNT_FORKS, REPO, run_forking

CODE = (
    r"""
import os, sys
import rngaudit.output.halves as halves
from rngaudit import api
from rngaudit.output.derive_json import json_chunks, jsonl_lines
from rngaudit.output.text_rows import derive_text

assert halves.can_fork(), "expected to fork here"
LINEN = '''
rngaudit: 1
rngs: {params: 0, dropout: 1}
model:
  class: Model
  body:
    - module:
        class: Block
        repeat: 40
        body:
          - make_rng: {stream: dropout, repeat: 300}
          - Dense: {features: 2}
    - vmap:
        module: {class: Mlp, body: [{make_rng: {stream: dropout, repeat: 50}}]}
        axis_size: 30
        split_rngs: {params: true, dropout: true}
    - make_rng: {stream: dropout, repeat: 3}
'''
NNX = '''
rngaudit: 1
flavour: nnx
rngs: {params: 0, dropout: 1}
steps: 30
model:
  class: M
  keep_rngs: true
  init: [{Linear: {name: l}}, {Dropout: {name: d, rate: 0.5}}]
  call:
    - {call: {name: d, repeat: 400}}
    - {draw: {stream: dropout, repeat: 400}}
'''
"""
    + COUNT_FORKS
    + r"""
def outputs(report):
    return (
        "".join(jsonl_lines(report)),
        "".join(json_chunks(report)),
        "".join(derive_text(report, width=None, color=False, max_rows=0)),
    )

for name, text in (("linen.yaml", LINEN), ("nnx.yaml", NNX)):
    with open(name, "w") as f:
        f.write(text)
    report = api.derive(name)
    assert len(report.calls) > 10000, len(report.calls)
    halves.PARALLEL_ROWS = 10**12
    one = outputs(report)
    assert not forks
    halves.PARALLEL_ROWS = 1000
    two = outputs(report)
    # jsonl, json and (Linen's) text: NNX's text rows are written by one process
    assert len(forks) == (3 if name == "linen.yaml" else 2), (name, forks)
    for a, b in zip(one, two):
        assert a == b, name
    real_write = os.write
    def failing_write(fd, data):  # only the child writes (its text, to its file): the child fails
        raise OSError(28, "No space left on device")
    os.write = failing_write
    failed = outputs(report)
    os.write = real_write
    assert failed == one, name
    def failing_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    os.fork = failing_fork
    no_fork = outputs(report)
    os.fork = counting_fork
    assert no_fork == one, name
    # the reader stops after the first chunks: the child is ended and reaped, nothing left running
    lines = jsonl_lines(report)
    next(lines), next(lines)
    lines.close()
    try:
        os.waitpid(-1, os.WNOHANG)
        raise AssertionError("a child is left")
    except ChildProcessError:
        pass
    forks.clear()
assert "jax" not in sys.modules
print("ok")
"""
)


def test_two_processes_write_what_one_writes(tmp_path):
    run_forking(CODE, cwd=tmp_path)


def test_one_process_when_asked():
    """RNGAUDIT_HASH_PROCESSES=1 keeps the writing to one process too."""
    code = "import rngaudit.output.halves as h; print(h.can_fork())"
    env = dict(os.environ, RNGAUDIT_HASH_PROCESSES="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.strip() == "False", r.stderr


def test_an_interrupt_while_waiting_for_the_child_ends_it():
    """Ctrl-C while this process waits for the child (its own half done first, the usual case with -o) kills and
    reaps the child: none is left running, holding the terminal or a CI log's pipe open."""
    code = """
import os, signal, sys, time
import rngaudit.output.halves as h
assert h.can_fork(), "expected to fork here"
def make(a, b):
    if a:  # the child's half: slow
        time.sleep(30)
    yield "x" * (b - a), b - a
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.5)
g = h.in_two(make, 200_000, 1)
t = time.perf_counter()
try:
    for _ in g:
        pass
    raise AssertionError("not interrupted")
except KeyboardInterrupt:
    g.close()
assert time.perf_counter() - t < 10
try:
    os.waitpid(-1, os.WNOHANG)
    raise AssertionError("a child is left")
except ChildProcessError:
    pass
print("ok")
"""
    run_forking(code, timeout=120)
