"""Shared fixtures: tiny random models of each supported family, and the real built-in model, each imported once;
``process_logs``, which puts the logs of the processes a test started into its failure report; ``session_summary``,
for figures shown at the end of the run.

Markers (pyproject.toml): unmarked tests are fast units; ``e2e``, ``lab`` and ``browser`` mark the slow kinds, so
``pytest -m "not e2e and not lab and not browser"`` is the quick check. Plain ``pytest`` runs everything."""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import trio

# Before torch is first imported (OpenMP reads it once): OpenMP threads sleep between parallel regions instead of
# spinning. The tests put several torch users on this 2-core machine at once (fellows in-process and as processes,
# the lab's leader and fellows, another test run): spinning threads starve each other. Measured here with another
# e2e run going: the fast selection took 127 s spinning, 38 s passive. Inherited by the processes tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Fellows time a decoder layer when they join (swarm.fellow.calibration, ~3 s of CPU): off in tests, where a fresh
# data dir per fellow would pay it each time; the planner's tests turn it on.
os.environ.setdefault("SWARM_CALIBRATE", "0")

# name -> (config class, config kwargs). Hidden 64, a few layers, vocab 320: milliseconds per token on a laptop CPU.
# initializer_range 0.2 (library default 0.02) makes random models produce varied tokens instead of one token
# repeated, so an exact-match comparison means something.
_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_MODELS = {
    # Qwen2 with sliding-window attention on its upper layers: exercises per-layer layer_types slicing.
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=16, max_window_layers=3,
                                  tie_word_embeddings=False)),
    # Qwen3: q_norm/k_norm and an explicit head_dim.
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=5, head_dim=16, tie_word_embeddings=False)),
    # Llama with tied embeddings, like the built-in SmolLM2.
    "llama": ("LlamaConfig", dict(num_hidden_layers=4, tie_word_embeddings=True)),
    # Mistral: one sliding window on every layer.
    "mistral": ("MistralConfig", dict(num_hidden_layers=4, head_dim=16, sliding_window=16, tie_word_embeddings=False)),
    # Phi-3: fused qkv_proj and gate_up_proj, a window on every layer.
    "phi3": ("Phi3Config", dict(num_hidden_layers=4, sliding_window=16, tie_word_embeddings=False)),
    # Gemma 3: scaled embedding, (1 + w) norms, q/k norms, local layers (window 8, their own rotary base) around a
    # global one; logit soft-capping (Gemma 2's 30.0; Gemma 3 checkpoints leave it off) to test the head. Untied: a
    # random tied one repeats the last token (its x8 embedding scale dominates), which would prove nothing.
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                       final_logit_softcapping=30.0, tie_word_embeddings=False)),
    # DeepSeek-R1 distills: a Qwen2 body (1.5B/7B/14B/32B) and a Llama 3 body with its rope scaling (8B/70B), both
    # stored in bfloat16 as published -- the ring and its reference then compute from the same 16-bit values.
    "r1-qwen": ("Qwen2Config", dict(num_hidden_layers=4, tie_word_embeddings=False), "bfloat16"),
    "r1-llama": ("LlamaConfig", dict(num_hidden_layers=4, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)), "bfloat16"),
}


def build_tiny_source(folder: Path, kind: str, dtype=None, **save_kwargs) -> Path:
    """Save a random-weight model of family ``kind`` as a transformers folder (no tokenizer) and return it
    (``save_kwargs`` go to save_pretrained, e.g. max_shard_size for a sharded folder)."""
    import torch
    import transformers

    class_name, kwargs, *stored = TINY_MODELS[kind]
    config = getattr(transformers, class_name)(**_TINY_COMMON, **kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config)
    dtype = dtype or (getattr(torch, stored[0]) if stored else None)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def shared_once(tmp_path_factory, name: str, build) -> Path:
    """A folder made once per run by ``build(folder)`` and shared by every pytest-xdist worker: the first worker to
    get here builds it under a file lock, the others wait for it and reuse it. Without xdist, once per session."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    folder = base / f"shared-{name}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """kind -> imported model dir, for every family in TINY_MODELS."""
    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for kind in TINY_MODELS:
            source = build_tiny_source(root / f"src-{kind}", kind)
            import_model(str(source), root / "models", kind)

    root = shared_once(tmp_path_factory, "tiny", build)
    return {kind: root / "models" / kind for kind in TINY_MODELS}


@pytest.fixture(scope="session")
def smollm_model_dir(tmp_path_factory) -> Path:
    """The built-in SmolLM2-135M-Instruct, imported once per test run (~15 s: the tokenizer rebuilt from the GGUF's
    vocabulary), its Q4_1 blocks kept as the file has them (stages dequantize them at load)."""
    from swarm.store.importer import builtin_gguf_path, import_model

    try:
        builtin_gguf_path()
    except Exception as exc:  # noqa: BLE001 - a declared dependency; skip, saying why, rather than fail where absent
        pytest.skip(str(exc))
    root = shared_once(tmp_path_factory, "models", lambda folder: import_model("smollm2-135m-instruct", folder))
    return root / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """Folders for a module's shared fixtures -- ``module_tmp("web")`` -- removed when the module's tests are done,
    unless one of them failed. Each leader keeps its own copy of the model (~300 MB): kept to the end of the session,
    as tmp_path_factory's folders are, a full run wrote 8-14 GB and a CI machine with less free disk failed with
    ENOSPC. (pyproject's tmp_path_retention_policy = "failed" does the same for each test's tmp_path.)"""
    made: list[Path] = []
    failed_before = request.session.testsfailed

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


# --- logs of the processes a test started, in its failure report --------------------------------------------------

_PROCESS_LOGS = pytest.StashKey[list]()
LOG_TAIL_LINES = 80
LOG_TAIL_CHARS = 12_000


def _tail(path: Path, lines: int = LOG_TAIL_LINES, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    tail = "\n".join(text.splitlines()[-lines:])
    return tail[-chars:] if len(tail) > chars else tail


@pytest.fixture
def process_logs(request):
    """Register the log files of processes this test started: ``process_logs(name, path)``, or
    ``process_logs(source)`` with a callable returning {name: path} (read when the report is made, so processes
    started later are included). When the test fails (setup, call or teardown), the last lines of each log are
    attached to its report as a section "log of <name>"."""
    sources = request.node.stash.setdefault(_PROCESS_LOGS, [])

    def register(name_or_source, path=None):
        if path is not None:
            sources.append(lambda: {name_or_source: path})
        elif callable(name_or_source):
            sources.append(name_or_source)
        else:
            sources.append(lambda: dict(name_or_source))

    return register


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    while _UNREPORTED:
        report.user_properties.append((_SUMMARY_KEY, _UNREPORTED.pop(0)))
    if report.failed:
        seen = set()
        for source in item.stash.get(_PROCESS_LOGS, []):
            try:
                logs = source()
            except Exception as exc:  # noqa: BLE001 - a broken source must not hide the failure itself
                report.sections.append(("log sources", f"could not list logs: {exc!r}"))
                continue
            for name, path in logs.items():
                if (name, str(path)) in seen:
                    continue
                seen.add((name, str(path)))
                report.sections.append((f"log of {name} ({path}, last {LOG_TAIL_LINES} lines)", _tail(path)))
    return report


# --- figures a module wants shown at the end of the run (the lab's NAT grid) ---------------------------------------

# An entry travels in the report of the test that made it (report.user_properties), so it reaches the terminal
# summary also from a pytest-xdist worker, where the summary is printed by another process.
_UNREPORTED: list[tuple[str, str]] = []
_REPORTED: list[tuple[str, str]] = []  # in the process that prints the summary
_SUMMARY_KEY = "swarm session summary"


@pytest.fixture(scope="session")
def session_summary():
    """``session_summary(title, text)`` prints ``text`` under ``title`` in pytest's terminal summary, without -s."""
    return lambda title, text: _UNREPORTED.append((title, text))


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == _SUMMARY_KEY:
            _REPORTED.append((value[0], value[1]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for title, text in _REPORTED:
        terminalreporter.write_sep("=", title)
        terminalreporter.write_line(text)


# --- every module's tests in one xdist worker; every trio test with a deadline that shows where it hangs -----------


def group_of(nodeid: str) -> str:
    """The worker group of a test: its module (a module's tests share its fleet, module-scoped fixtures, so they run
    in one worker, in order), or "lab" for the network lab's modules (test_lab_*.py, test_netlab.py), which share
    the host's network namespaces and nftables: one worker for all of them."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return "lab" if name.startswith("test_lab_") or name == "test_netlab.py" else path


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is in the test extra; without it the tests run in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _ByGroup(LoadScopeScheduling):
        """pytest-xdist's scope scheduling over group_of's groups, handed out in the order collected (heaviest
        first, see pytest_collection_modifyitems). Its own loadgroup reads groups off each test's node id, which
        pytest 9.2 no longer lets it rename (pytest-xdist issue #1386, open): every test was then a group of its
        own, a module's shared fleet started in both workers and the lab's modules ran side by side."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # its default sorts groups by their number of tests instead

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)


class _Scheduling:
    """Registered while pytest-xdist is (its hook is unknown to pytest otherwise)."""

    def pytest_xdist_make_scheduler(self, config, log):
        """`--dist loadgroup` (scripts/bootstrap test) as described at _ByGroup; other modes as pytest-xdist has
        them."""
        return _ByGroup(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_configure(config):
    if LoadScopeScheduling is not None and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Scheduling(), "swarm-scheduling")


def _cost(item, default_limit: float) -> float:
    """A rough weight of a test for ordering: a unit is ~1; a slow kind counts its time limit (300 s unless marked),
    which is a few times its time on CI and longer for the tests that need longer."""
    if not any(item.get_closest_marker(kind) for kind in ("e2e", "lab", "browser")):
        return 1.0
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark and mark.args else default_limit or 300.0


@pytest.hookimpl(trylast=True)  # after pytest-trio has marked the async tests
def pytest_collection_modifyitems(config, items):
    default_limit = float(config.getini("timeout") or 0)
    # The heaviest groups first, the fast units last: the workers (scripts/bootstrap test) start the long ones at
    # once and the units fill in the end, each over in moments (the longest-first rule for splitting jobs over
    # machines; by the number of tests, pytest-xdist's own order, the e2e modules of one or two slow tests came
    # last). A group's own tests keep their order.
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        group = group_of(item.nodeid)
        if item.get_closest_marker("lab") and group != "lab":
            raise pytest.UsageError(f"{item.nodeid} is a lab test: name its module test_lab_*.py, so that it runs "
                                    "in the lab's worker (tests/conftest.py group_of)")
        weight[group] = weight.get(group, 0.0) + _cost(item, default_limit)
        first.setdefault(group, index)
    items.sort(key=lambda item: (-weight[group_of(item.nodeid)], first[group_of(item.nodeid)]))
    for item in items:
        trio_mark = item.get_closest_marker("trio")
        if trio_mark is None:
            continue
        timeout_mark = item.get_closest_marker("timeout")
        limit = float(timeout_mark.args[0]) if timeout_mark and timeout_mark.args else default_limit
        if limit <= 0:
            continue
        run = trio_mark.kwargs.get("run", trio.run)
        item.add_marker(pytest.mark.trio(run=_run_with_deadline(run, limit, item.nodeid)), append=False)
        # pytest-timeout stays the backstop, for a loop blocked where a cancellation cannot reach.
        item.add_marker(pytest.mark.timeout(limit + 60), append=False)


def _run_with_deadline(run, limit: float, nodeid: str):
    """``run`` (trio.run) with a deadline of ``limit`` real seconds (an autojump clock does not move it): past it,
    the trio task tree and every thread's stack are printed, the test is cancelled and fails, and the run goes on."""

    def run_with_deadline(fn, **kwargs):
        scopes: list[trio.CancelScope] = []
        token: list = []

        async def guarded():
            token.append(trio.lowlevel.current_trio_token())
            with trio.CancelScope() as scope:
                scopes.append(scope)
                return await fn()
            pytest.fail(f"{nodeid} ran past its time limit of {limit:.0f} s (stacks above, on stderr)", pytrace=False)

        def expire():
            sys.stderr.write(f"\n=== {nodeid}: past its time limit of {limit:.0f} s; where each thread is:\n")
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            if token:
                token[0].run_sync_soon(cancel)

        def cancel():
            sys.stderr.write(f"=== {nodeid}: trio tasks:\n{_trio_tasks()}\n")
            sys.stderr.flush()
            scopes[0].cancel()

        timer = threading.Timer(limit, expire)
        timer.daemon = True
        timer.start()
        try:
            return run(guarded, **kwargs)
        finally:
            timer.cancel()

    return run_with_deadline


def _trio_tasks() -> str:
    """The trio task tree, each task with the lines it waits on (trio's own frames left out)."""
    lines: list[str] = []

    def show(task, depth: int) -> None:
        lines.append("  " * depth + f"task {task.name}")
        for frame, lineno in task.iter_await_frames():
            path = frame.f_code.co_filename
            if f"{os.sep}trio{os.sep}" not in path:
                lines.append("  " * depth + f"  {path}:{lineno} in {frame.f_code.co_name}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                show(child, depth + 1)

    show(trio.lowlevel.current_root_task(), 0)
    return "\n".join(lines)


# --- the store on both backends ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server for this run (tests/pg_server.py); the PostgreSQL variants skip, saying why,
    where its binaries are missing (scripts/bootstrap test installs them)."""
    from pg_server import PostgresServer

    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'psycopg[binary]' psycopg_pool")
    try:
        server = PostgresServer()
    except FileNotFoundError as exc:
        pytest.skip(f"no PostgreSQL server to test against: {exc}")
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request, tmp_path: Path) -> Path | str:
    """Where a test's leader store lives: a SQLite file in its tmp dir, or a new database on the test server."""
    if request.param == "sqlite":
        return tmp_path / "leader" / "swarm.db"
    return request.getfixturevalue("postgres_server").new_database()
