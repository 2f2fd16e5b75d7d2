"""The skip policy of tests/conftest.py, run by a pytest in a subprocess on a copy of the conftest
and the project's pytest settings: a skip (or xfail) of a test not marked `gpu` fails the run and
is named with its reason; a `gpu` test is skipped on a machine without a GPU, listed by -rs, and
the run passes."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

FILES = {
    "test_fine.py": """
        import pytest

        def test_passes():
            pass

        @pytest.mark.gpu
        def test_on_a_gpu():
            raise AssertionError("ran without a GPU")
    """,
    "test_skips.py": """
        import pytest

        def test_passes():
            pass

        def test_skips_unmarked():
            pytest.skip("the tokenizer is not installed")

        @pytest.mark.xfail(reason="flaky")
        def test_xfails():
            raise AssertionError
    """,
    "test_gpu_skips.py": """
        import pytest

        @pytest.mark.gpu
        def test_needs_more_gpus():
            pytest.skip("needs 2 GPUs, this host has 1")

        @pytest.mark.gpu
        def test_skips_for_another_reason():
            pytest.skip("slow on this GPU")
    """,
    "test_module_skip.py": """
        import pytest

        pytest.importorskip("no_such_package_anywhere")

        def test_never_collected():
            pass
    """,
}


def _pytest(tmp_path: Path, *files: str, fake_gpu: bool = False, args=()) -> tuple[int, str]:
    conftest = (TESTS / "conftest.py").read_text()
    if fake_gpu:  # the copy believes it runs on a GPU machine: `gpu` tests are not skipped
        head = "def no_gpu_reason() -> str | None:\n"
        assert head in conftest
        conftest = conftest.replace(head, head + "    return None  # FAKE: a GPU machine\n", 1)
    (tmp_path / "conftest.py").write_text(conftest)
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")  # markers, strict
    for name, text in FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", PYTEST_ADDOPTS="", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args, *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_only_gpu_tests_may_skip(tmp_path):
    code, out = _pytest(tmp_path, "test_fine.py")
    print(out)
    assert code == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert (
        "SKIPPED [1] test_fine.py:7: needs a GPU (none visible: "
        "jax.default_backend() == 'cpu', JAX_PLATFORMS='cpu')"
    ) in out, out
    assert "skip policy" not in out, out


def test_any_other_skip_fails_the_run_and_is_named(tmp_path):
    code, out = _pytest(tmp_path, "test_fine.py", "test_skips.py", "test_module_skip.py")
    print(out)
    assert code == 1, out
    policy = out[out.index("skip policy violated") :]
    assert "3 test(s) skipped or xfailed" in policy, out
    assert (
        "test_skips.py::test_skips_unmarked: skipped at test_skips.py:8: "
        "the tokenizer is not installed"
    ) in policy, out
    assert "test_skips.py::test_xfails: xfail: flaky" in policy, out
    assert (
        "test_module_skip.py: skipped at test_module_skip.py:4: "
        "could not import 'no_such_package_anywhere'"
    ) in policy, out
    assert "test_on_a_gpu" not in policy, out  # the allowed skip is listed by -rs only
    assert "needs a GPU" in out, out


def test_on_a_fake_gpu_machine_a_gpu_test_may_skip_only_for_missing_gpus(tmp_path):
    """The GPU tier: a `gpu` test may skip for GPUs the host lacks, not for any other reason."""
    code, out = _pytest(tmp_path, "test_gpu_skips.py", fake_gpu=True)
    print(out)
    assert code == 1, out
    policy = out[out.index("skip policy violated") :]
    assert "1 test(s) skipped or xfailed" in policy, out
    assert "test_gpu_skips.py::test_skips_for_another_reason" in policy, out
    assert "test_needs_more_gpus" not in policy, out


def test_the_policy_holds_on_xdist_workers(tmp_path):
    """The slow tier's two pytest-xdist workers: the workers collect and run, the controller
    judges their reports; the `gpu` skip passes, any other skip still fails the run."""
    code, out = _pytest(tmp_path, "test_fine.py", "test_skips.py", args=("-p", "xdist", "-n", "2"))
    print(out)
    assert code == 1, out
    policy = out[out.index("skip policy violated") :]
    assert "2 test(s) skipped or xfailed" in policy, out
    assert "test_skips.py::test_skips_unmarked" in policy, out
    assert "test_skips.py::test_xfails: xfail: flaky" in policy, out
    assert "test_on_a_gpu" not in policy, out
