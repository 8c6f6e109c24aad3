"""Run diffusers' own model tests for the three transformers with and without this package's processors; compare.

For each Python (one virtual environment per diffusers version) and each ``--trtllm-processors`` mode it runs the
selected test files of diffusers' test tree for that version (``trtllm_processors_plugin`` loaded, compile tests
on the CPU), then writes a table of passed / failed / skipped per version and mode and the regressions: tests that
pass with diffusers' own processors (mode ``none``) and fail with this package's.

diffusers' tests are not in its wheel (its sdist holds only ``tests/testing_utils.py``) and their code stays out of
this repository. They are extracted with ``git archive`` from a git copy of diffusers' repository (``--diffusers-git``
or ``$DIFFUSERS_GIT``) into a cache (``--tests-cache`` or ``$DIFFUSERS_TESTS``), one tree per version; a tree
already in the cache is used as it is. :data:`TEST_TREE_TAGS` says which tag each version's tests come from.

Example (the two venvs of the README)::

    python tests/upstream/run_upstream.py --python /work/venv/bin/python --python /work/venv-d040/bin/python \\
        --diffusers-git /path/to/diffusers.git --output upstream-results

Exit status: 0 when no test regressed, 1 when some did, 2 on bad arguments or a missing test tree (one line on
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

MODES = ("none", "sdpa", "reference-dense", "reference-skip", "reference-sage")
BASELINE_MODE = "none"

TEST_FILES = (
    "tests/models/transformers/test_models_transformer_wan.py",
    "tests/models/transformers/test_models_transformer_hunyuan_1_5.py",
    "tests/models/transformers/test_models_transformer_cosmos3.py",
    "tests/models/transformers/test_trtllm_hunyuan_video15_compile.py",
)
#: test cases of this repository (cases/) copied into each tree: compile tests diffusers has no class for.
EXTRA_CASES = {"hunyuan_video15_compile.py": "tests/models/transformers/test_trtllm_hunyuan_video15_compile.py"}
#: what the model test files import besides themselves.
SUPPORT_PATHS = (
    "tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", "tests/models/__init__.py",
    "tests/models/testing_utils", "tests/models/transformers/__init__.py",
)

#: diffusers version -> the git tag its test tree is taken from. 0.42.1 has no tag in the diffusers snapshot this
#: was built with (its newest release tag is v0.40.0; main's test files for these models equal the tag's), so
#: 0.42.1 runs the v0.40.0 tests; they import and run unchanged against 0.42.1.
TEST_TREE_TAGS = {"0.40.0": "v0.40.0", "0.42.1": "v0.40.0"}

OUTCOMES = ("passed", "failed", "skipped")
REASON_CHARS = 160  # of a regression's failure message in the table


class UsageError(Exception):
    """Bad arguments or a missing input: reported as one line on stderr, exit status 2."""


def diffusers_version(python: str) -> str:
    found = subprocess.run([python, "-c", "import diffusers; print(diffusers.__version__)"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise UsageError(f"--python {python}: cannot import diffusers ({found.stderr.strip().splitlines()[-1:]})")
    return found.stdout.strip()


def tree_for_version(version: str, cache: Path, diffusers_git: str | None, test_files: tuple[str, ...]) -> Path:
    """The cached test tree for ``version``, extracted from ``diffusers_git`` first if it is not there yet."""
    tree = cache / f"v{version}"
    upstream_files = tuple(path for path in test_files if path not in EXTRA_CASES.values())
    if not all((tree / path).exists() for path in SUPPORT_PATHS + upstream_files):
        extract(version, tree, diffusers_git, upstream_files)
    for case, destination in EXTRA_CASES.items():
        shutil.copyfile(HERE / "cases" / case, tree / destination)
    return tree


def extract(version: str, tree: Path, diffusers_git: str | None, test_files: tuple[str, ...]) -> None:
    """Write the test files of `version`'s tag (TEST_TREE_TAGS) and what they import into `tree`."""
    if version not in TEST_TREE_TAGS:
        raise UsageError(f"diffusers {version}: no test tree tag known; known versions: {sorted(TEST_TREE_TAGS)}")
    if not diffusers_git:
        raise UsageError(f"no diffusers test tree at {tree} and no --diffusers-git / $DIFFUSERS_GIT to extract it from")
    tag = TEST_TREE_TAGS[version]
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir", diffusers_git, "archive", tag, *SUPPORT_PATHS, *test_files],
                             capture_output=True)
    if archive.returncode != 0:
        raise UsageError(f"--diffusers-git {diffusers_git}: git archive {tag} failed: "
                         f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "x", "-C", str(partial)], input=archive.stdout, check=True)
    (partial / "SOURCE").write_text(f"diffusers {tag} from {diffusers_git}\n")
    shutil.rmtree(tree, ignore_errors=True)
    partial.rename(tree)


def run_pytest(python: str, tree: Path, mode: str, test_files: tuple[str, ...], selection: str | None,
               junit: Path, log: Path) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    command = [python, "-m", "pytest", *test_files, "-p", "trtllm_processors_plugin", "--trtllm-processors", mode,
               "--compile-tests-on-cpu", "-p", "no:cacheprovider", "-q", "-rfE", "--durations=10", f"--junitxml={junit}"]
    if selection:
        command += ["-k", selection]
    start = time.monotonic()
    with log.open("w") as out:
        subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    return time.monotonic() - start


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Test id (``test_file.py::Class::test``) -> (passed / failed / skipped, the failure's first line), from a JUnit XML
    report; errors count as failed."""
    results = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        module, cls = case.get("classname").rsplit(".", 1)
        test_id = f"{module.rsplit('.', 1)[-1]}.py::{cls}::{case.get('name')}"
        failures = [child for child in case if child.tag in ("failure", "error")]
        if failures:
            message = (failures[0].get("message") or "").split("\n")[0]
            results[test_id] = ("failed", message[:REASON_CHARS])
        else:
            results[test_id] = ("skipped" if any(child.tag == "skipped" for child in case) else "passed", "")
    return results


def comparison(results: dict[str, dict[str, dict[str, tuple[str, str]]]],
               seconds: dict[str, dict[str, float]]) -> tuple[str, dict]:
    """Markdown table, and the regressions (test id -> failure message) per version and mode."""
    lines = ["| diffusers | processors | passed | failed | skipped | regressions | fixed | time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    regressions = {}
    for version, by_mode in results.items():
        baseline = {test: outcome for test, (outcome, _) in by_mode.get(BASELINE_MODE, {}).items()}
        for mode, tests in by_mode.items():
            counts = {outcome: sum(1 for value, _ in tests.values() if value == outcome) for outcome in OUTCOMES}
            regressed = {test: reason for test, (value, reason) in sorted(tests.items())
                         if value == "failed" and baseline.get(test) == "passed"}
            fixed = [test for test, (value, _) in tests.items() if value == "passed" and baseline.get(test) == "failed"]
            regressions.setdefault(version, {})[mode] = regressed
            marks = ("-", "-") if mode == BASELINE_MODE else (len(regressed), len(fixed))
            lines.append(f"| {version} | {mode} | {counts['passed']} | {counts['failed']} | {counts['skipped']} | "
                         f"{marks[0]} | {marks[1]} | {seconds[version][mode]:.0f} |")
    lines.append("")
    for version, by_mode in regressions.items():
        for mode, regressed in by_mode.items():
            if regressed:
                lines.append(f"Regressions, diffusers {version}, {mode}:")
                lines += [f"- `{test}`: {reason}" for test, reason in regressed.items()]
                lines.append("")
    return "\n".join(lines), regressions


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", required=True,
                        help="a Python whose environment has diffusers, torch and pytest (repeat for each version)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    parser.add_argument("--files", default=",".join(TEST_FILES), help="comma-separated test files of the tree")
    parser.add_argument("-k", dest="selection", help="pytest -k expression selecting a subset")
    parser.add_argument("--tests-cache", default=os.environ.get("DIFFUSERS_TESTS",
                                                                 str(Path.home() / ".cache/diffusers-tests")),
                        help="where the test trees are cached, one v<version>/ each (default $DIFFUSERS_TESTS)")
    parser.add_argument("--diffusers-git", default=os.environ.get("DIFFUSERS_GIT"),
                        help="git directory of diffusers' repository holding the tags (default $DIFFUSERS_GIT)")
    parser.add_argument("--jobs", type=int, default=1, help="pytest runs at once (each is one process)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse a version and mode's report already in --output instead of running it again")
    parser.add_argument("--output", default="upstream-results", help="folder for the logs, JUnit XML and table")
    args = parser.parse_args(argv)
    args.modes = tuple(args.modes.split(","))
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown:
        raise UsageError(f"--modes: unknown {unknown}; valid: {MODES}")
    if BASELINE_MODE not in args.modes:
        raise UsageError(f"--modes {','.join(args.modes)}: must include {BASELINE_MODE!r}, the baseline compared with")
    args.files = tuple(args.files.split(","))
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        output = Path(args.output)
        output.mkdir(parents=True, exist_ok=True)
        plan = []
        for python in args.python:
            version = diffusers_version(python)
            tree = tree_for_version(version, Path(args.tests_cache), args.diffusers_git, args.files)
            plan.append((python, version, tree))
    except UsageError as error:
        print(f"run_upstream: {error}", file=sys.stderr)
        return 2
    results = {version: {} for _, version, _ in plan}
    seconds = {version: {} for _, version, _ in plan}

    def run(python: str, version: str, tree: Path, mode: str) -> None:
        name = f"diffusers-{version}-{mode}"
        junit = output / f"{name}.xml"
        if args.resume and junit.exists():
            elapsed = float("nan")  # not timed in this invocation
        else:
            elapsed = run_pytest(python, tree, mode, args.files, args.selection, junit, output / f"{name}.log")
        if not junit.exists():
            raise RuntimeError(f"diffusers {version} {mode}: pytest wrote no report; see {output / name}.log")
        results[version][mode] = outcomes(junit)
        seconds[version][mode] = elapsed
        print(f"diffusers {version} {mode}: {elapsed:.0f} s", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(run, python, version, tree, mode) for python, version, tree in plan for mode in args.modes]
        for finished in runs:
            finished.result()
    results = {version: {mode: by_mode[mode] for mode in args.modes} for version, by_mode in results.items()}
    table, regressions = comparison(results, seconds)
    sources = "\n".join(f"- diffusers {version}: tests from {(tree / 'SOURCE').read_text().strip()}"
                        if (tree / "SOURCE").exists() else f"- diffusers {version}: tests from {tree}"
                        for _, version, tree in plan)
    (output / "comparison.md").write_text(f"{table}\nTest trees:\n{sources}\n")
    (output / "results.json").write_text(json.dumps({"results": results, "regressions": regressions}, indent=1))
    print(table)
    return 1 if any(any(by_mode.values()) for by_mode in regressions.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
