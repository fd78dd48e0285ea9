"""Speculator start-up never hangs: scripts on stdin and ``python -c`` work, and a worker that dies or
stalls while starting gives a clear error (how it ended, its last words, what to do) instead of a wait.

The subprocess timeouts below are hang guards, not timing assertions: a run that hangs fails there.
"""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.workers import process as launch
from saguaro.workers.process import WorkerStartError
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.host import SpeculatorOptions
from saguaro.ssd.worker import WorkerLink
from tests.tiny import weak_pair

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 60

SCRIPT = textwrap.dedent("""
    from saguaro import LLM, SamplingParams
    from tests.tiny import PROMPTS, greedy_tokens, weak_pair
    target, draft = weak_pair()
    with LLM(target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4) as llm:
        ssd = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12))]
        assert llm.engine.decoder.failure is None, llm.engine.decoder.failure
    assert ssd == greedy_tokens(target, PROMPTS, 12), "SSD differs from AR"
    print("SSD OK")
""")


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, **kw)


def test_ssd_from_a_script_on_stdin_completes():
    done = _run(["-"], input=SCRIPT)
    assert done.returncode == 0 and "SSD OK" in done.stdout, done.stderr[-3000:]


def test_ssd_from_python_dash_c_completes():
    done = _run(["-c", SCRIPT])
    assert done.returncode == 0 and "SSD OK" in done.stdout, done.stderr[-3000:]


def _opts(timeout_s: float = 60) -> SpeculatorOptions:
    return SpeculatorOptions(plan=SpecPlan.fixed([1, 1, 1, 1], 1.0, "jit"), dtype=torch.float32, device="cpu",
                         cores=None, threads=1, kv_cache_tokens=256, block_size=4, timeout_s=timeout_s)


@pytest.fixture
def started(monkeypatch):
    """Record every worker process started, and apply ``action`` to it right after the start."""
    seen: list[launch.WorkerProcess] = []
    action = {"do": lambda process: None}
    original = launch.WorkerProcess.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self)
        action["do"](self)

    monkeypatch.setattr(launch.WorkerProcess, "__init__", init)
    return seen, action


def test_worker_killed_during_start_up_is_a_clear_error(started):
    seen, action = started
    action["do"] = lambda process: os.kill(process.pid, signal.SIGKILL)
    target, draft = weak_pair()
    with pytest.raises(WorkerStartError) as err:
        LLM(target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4)
    message = str(err.value)
    assert "killed by signal 9 (SIGKILL)" in message and "What to do" in message
    assert not seen[0].is_alive()


def test_worker_error_during_start_up_shows_its_traceback(started):
    seen, _ = started
    with pytest.raises(WorkerStartError) as err:
        WorkerLink("no-such-model", _opts())
    message = str(err.value)
    assert "exited with code 1" in message and "no-such-model" in message and "What to do" in message
    assert not seen[0].is_alive()


def test_silent_worker_times_out_and_is_killed(started):
    seen, action = started
    action["do"] = lambda process: os.kill(process.pid, signal.SIGSTOP)  # alive, but never connects
    target, draft = weak_pair()
    with pytest.raises(WorkerStartError) as err:
        WorkerLink(draft, _opts(timeout_s=3))
    assert "did not finish connecting within 3 s" in str(err.value)
    assert not seen[0].is_alive()


def test_worker_exits_when_its_engine_is_gone():
    """An orphaned speculator (its engine killed) notices and exits instead of polling forever."""
    script = textwrap.dedent("""
        import os, sys
        from saguaro import LLM
        from tests.tiny import weak_pair
        target, draft = weak_pair()
        llm = LLM(target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4)
        print(llm.engine.decoder.link.process.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    done = _run(["-c", script])
    pid = int(done.stdout.split()[0])
    for _ in range(HANG_GUARD_S * 10):
        if not _exists(pid):
            break
        subprocess.run(["sleep", "0.1"])
    assert not _exists(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # a zombie has exited


def test_greedy_ssd_equals_ar_with_a_named_draft():
    """The draft given by name travels as the name: the worker loads it itself."""
    from saguaro.loading import MODELS, installed
    if not installed(MODELS["smollm2-135m"]):
        pytest.skip("smollm2-135m is not installed")
    with LLM("smollm2-135m", draft="smollm2-135m", mode="ssd", num_speculative_tokens=2, dtype="float32",
             kv_cache_tokens=512) as llm:
        ssd = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].token_ids
    with LLM("smollm2-135m", dtype="float32", kv_cache_tokens=512) as llm:
        ar = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].token_ids
    assert ssd == ar
