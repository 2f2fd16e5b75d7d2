"""Test setup: 4 fake CPU devices for every test (1-device tests use a sub-mesh), and the skip
policy: a test may be skipped only for hardware this machine lacks. Tests marked `gpu` are
skipped when JAX sees no GPU, and may skip themselves for fewer GPUs than they need ("needs n
GPUs, this host has k"); any other skip, and any xfail, fails the session (exit status 1)
with a section naming each such test and its reason. A missing package is an error, not a skip.

With --coverage-gate (the fast tier: .ci/run, README), coverage.py measures rl/, models/ and
launch/ in this process, from before any test module imports them, and the run fails naming
each .py file of theirs that ran no line."""

import atexit
import io
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=4"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the session and every process it starts (the same tiny
# programs compile in many runs; loading one is the same executable, so only time changes).
# .ci/run shares one between its two tiers; otherwise it is a directory of this session's.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="tandem-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def no_gpu_reason() -> str | None:
    """Why a `gpu` test cannot run here, or None when JAX's default backend is a GPU. Under
    conftest's default JAX_PLATFORMS=cpu, JAX initialises only its CPU backend (no GPU probe);
    run with JAX_PLATFORMS=cuda to run `gpu` tests on a GPU machine."""
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return (
        f"needs a GPU (none visible: jax.default_backend() == {backend!r}, "
        f"JAX_PLATFORMS={platforms!r})"
    )


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail{' (passed)' if report.passed else ''}: {report.wasxfail or 'no reason'}"
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, line, message = report.longrepr  # where pytest.skip was called, "Skipped: why"
        message = message.removeprefix("Skipped: ")
        return f"skipped at {os.path.relpath(path)}:{line}: {message}"
    return f"skipped: {report.longrepr}"


# The one other hardware skip a `gpu` test may take: pytest.skip(f"needs {n} GPUs, this host
# has {k}") with k < n.
HARDWARE_SKIP = re.compile(r"needs (\d+) GPUs, this host has (\d+)")


class SkipPolicy:
    """Collects every skip / xfail that is not a `gpu` test skipped for want of a GPU."""

    def __init__(self):
        self.gpu_tests: set[str] = set()
        self.offenders: dict[str, str] = {}  # nodeid -> reason

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
        self.gpu_tests = {item.nodeid for item in gpu}
        reason = no_gpu_reason() if gpu else None
        if reason is not None:
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason=reason))

    def _note(self, report):
        if hasattr(report, "wasxfail") or (report.skipped and not self._hardware(report)):
            self.offenders.setdefault(report.nodeid or "(collection)", _reason(report))

    def _hardware(self, report) -> bool:
        """A `gpu` test skipped for hardware this machine lacks: no GPU at all, or fewer GPUs
        than it needs (the message of HARDWARE_SKIP); a `gpu` test skipped for anything else
        on a GPU machine breaks the policy too. (Under xdist the workers collect: the report's
        keywords say whether the test is a `gpu` one.)"""
        if report.nodeid not in self.gpu_tests and "gpu" not in getattr(report, "keywords", {}):
            return False
        reason = _reason(report)
        short = HARDWARE_SKIP.search(reason)
        return "needs a GPU (none visible" in reason or (
            short is not None and int(short[2]) < int(short[1])
        )

    def pytest_runtest_logreport(self, report):
        self._note(report)

    def pytest_collectreport(self, report):
        if report.skipped:  # a whole module skipped while it was imported
            self._note(report)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.offenders and exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.offenders:
            return
        tr = terminalreporter
        tr.section("skip policy violated", sep="=", red=True, bold=True)
        tr.line(
            f"{len(self.offenders)} test(s) skipped or xfailed without being a `gpu` test on a "
            "machine without a GPU; only missing hardware may skip a test (a missing package "
            "is an error, xfail hides nothing):",
            red=True,
        )
        for nodeid, reason in self.offenders.items():
            tr.line(f"  {nodeid}: {reason}", red=True)


GATED = ("rl", "models", "launch")  # the packages every .py file of which the fast tier must run


COVERAGE_DIR = "TANDEM_COVERAGE_DIR"  # where pytest-xdist workers leave their coverage data


class CoverageGate:
    """Measures GATED with coverage.py from configure to session finish (this process only:
    subprocesses are not measured); fails a passing run when a .py file of theirs ran no line.
    Under pytest-xdist each worker measures and saves its data (`worker`), and the controller
    (`combine`) joins them before the check."""

    def __init__(self, root: Path, *, worker: str | None = None, combine: bool = False):
        try:
            import coverage  # noqa: F401 - a clear error before any test runs
        except ImportError as e:
            raise pytest.UsageError(
                "--coverage-gate needs coverage.py: python -m pip install coverage"
            ) from e
        self.worker, self.combine, self.root = worker, combine, root
        self.files = sorted(p for pkg in GATED for p in (root / pkg).rglob("*.py"))
        self.unrun: list[Path] | None = None  # None: not checked (the run failed already)
        self.percent = 0.0
        if combine:  # the controller runs no test: its workers measure
            return
        early = sorted(m for m in sys.modules if m.split(".")[0] in GATED)
        if early:  # their module-level lines would already have run, unmeasured
            raise pytest.UsageError(
                f"--coverage-gate started after {', '.join(early)} had been imported; "
                "nothing may import them before tests/conftest.py's pytest_configure"
            )
        data_file = (
            None
            if worker is None
            else os.path.join(os.environ[COVERAGE_DIR], f".coverage.{worker}")
        )
        self.cov = self._coverage(data_file)
        self.cov.start()

    def _coverage(self, data_file: str | None):
        import coverage

        source = [str(self.root / pkg) for pkg in GATED]
        return coverage.Coverage(source=source, data_file=data_file, config_file=False)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.combine:
            self.cov = self._coverage(os.path.join(os.environ[COVERAGE_DIR], ".coverage"))
        else:
            self.cov.stop()
            if self.worker is not None:
                self.cov.save()  # the controller checks the workers' data together
                return
        if exitstatus != pytest.ExitCode.OK:
            return  # an incomplete or failing run would list files its failures left unrun
        if self.combine:
            self.cov.combine([os.environ[COVERAGE_DIR]])
        data = self.cov.get_data()
        self.unrun = [p for p in self.files if not data.lines(str(p))]
        if self.unrun:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            self.percent = self.cov.report(file=io.StringIO())

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        if self.worker is not None:
            return
        if self.unrun is None:
            tr.line("coverage gate: not checked (the run did not pass)")
        elif not self.unrun:
            tr.line(
                f"coverage gate: each of the {len(self.files)} .py files of rl/, models/, "
                f"launch/ ran (in-process line coverage {self.percent:.0f}%)"
            )
        else:
            tr.section("coverage gate failed", sep="=", red=True, bold=True)
            tr.line(
                f"{len(self.unrun)} .py file(s) of rl/, models/, launch/ ran no line in the "
                "tests' processes; import and exercise each from a test of this tier:",
                red=True,
            )
            for path in self.unrun:
                tr.line(f"  {os.path.relpath(path)}", red=True)


# Modules that start a local Ray cluster: under xdist (`-n N --dist loadgroup`, the slow tier in
# .ci/run) they share one worker, one cluster at a time; every other module stays whole on one
# worker (its module-scoped vLLM hosts and models started once).
RAY_MODULES = {"test_chaos", "test_engine_contract", "test_ray_transport", "test_sweep"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        item.add_marker(pytest.mark.xdist_group("ray" if module in RAY_MODULES else module))


def pytest_addoption(parser):
    parser.addoption(
        "--coverage-gate",
        action="store_true",
        help="measure rl/, models/, launch/ with coverage.py; fail if any .py file ran no line",
    )


def pytest_configure(config):
    config.pluginmanager.register(SkipPolicy(), "tandem-skip-policy")
    if config.getoption("--coverage-gate"):
        root = Path(__file__).resolve().parent.parent
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        combine = worker is None and bool(getattr(config.option, "numprocesses", None))
        if combine:  # the xdist controller: the workers it starts inherit the directory
            os.environ[COVERAGE_DIR] = tempfile.mkdtemp(prefix="tandem-coverage-")
            atexit.register(shutil.rmtree, os.environ[COVERAGE_DIR], ignore_errors=True)
        gate = CoverageGate(root, worker=worker, combine=combine)
        config.pluginmanager.register(gate, "tandem-coverage-gate")
