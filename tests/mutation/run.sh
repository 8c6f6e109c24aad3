#!/usr/bin/env bash
# Mutation testing of one semantic module with mutmut 3 (docs/mutation-testing.md): copies the working tree to a
# scratch folder (mutmut rewrites files; the checkout is never touched), gives mutmut its settings there, runs the
# module's own tests against every mutant and prints the counts. Usage: tests/mutation/run.sh MODULE [mutmut args]
# MODULE: config | quant | plan | stats | steps | ops | reference | calibration.
# Scratch folder: $MUTATION_DIR (default /tmp/diffusers-trtllm-mutation).
set -euo pipefail -o noglob
{  # read whole before it runs: editing this file during a run (hours) must not change the running copy
module=${1:-}
shift || true
# tests slower than a minute on a loaded 2-core machine are left out of every mutant's run (the fp8 tensor-core
# emulation's own fast tests cover it); the selection is printed with the scores
deselect="not slow and not emulated_fp8_accumulation_only_changes and not skipped_tiles_grow_with_lambda"
case "$module" in
  config) sources="diffusers_trtllm/config.py"
          tests="tests/test_config.py tests/test_config_precedence.py tests/test_config_edges.py
                 tests/test_accuracy_probe.py tests/test_hopper_dense_kernel.py" ;;
  quant) sources="diffusers_trtllm/quant.py"
         tests="tests/test_reference.py tests/test_semantics_edges.py tests/test_quant_edges.py" ;;
  plan) sources="diffusers_trtllm/plan.py"
        tests="tests/test_semantics_edges.py tests/test_install_lifecycle.py tests/test_state_ownership.py
               tests/test_dispatch_backend.py tests/test_accuracy_probe.py tests/test_plan_edges.py" ;;
  stats) sources="diffusers_trtllm/stats.py"
         tests="tests/test_stats_edges.py tests/test_semantics_edges.py tests/test_state_ownership.py
                tests/test_install_lifecycle.py tests/test_accuracy_probe.py" ;;
  steps) sources="diffusers_trtllm/steps.py"
         tests="tests/test_steps_edges.py tests/test_state_ownership.py tests/test_install_lifecycle.py
                tests/test_semantics_edges.py tests/test_accuracy_probe.py" ;;
  ops) sources="diffusers_trtllm/ops.py"
       tests="tests/test_ops_edges.py tests/test_dispatch_backend.py tests/test_semantics_edges.py
              tests/test_host_sync.py tests/test_accuracy_probe.py" ;;
  reference) sources="diffusers_trtllm/backends/reference.py"
             tests="tests/test_reference_edges.py tests/test_reference.py tests/test_semantics_edges.py" ;;
  calibration) sources="diffusers_trtllm/calibration/*"
               tests="tests/test_calibration.py tests/test_calibration_edges.py tests/test_calibration_fit.py
                      tests/test_calibration_checkpoint.py" ;;
  *) echo "usage: $0 config|quant|plan|stats|steps|ops|reference|calibration [mutmut run arguments]:" \
          "got '$module'" >&2; exit 2 ;;
esac
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${MUTATION_DIR:-/tmp/diffusers-trtllm-mutation}/$module
rm -rf "$work" && mkdir -p "$work"
# the committed tree (others' edits in progress stay out), then the module's test files as they are in the checkout
git -C "$repo" archive HEAD | tar -xf - -C "$work"
for t in $tests tests/helpers.py; do if [ -f "$repo/$t" ]; then cp "$repo/$t" "$work/$t"; fi; done
{
  printf '\n[mutmut]\nsource_paths = diffusers_trtllm\nalso_copy = examples\nonly_mutate =\n'
  for s in $sources; do printf '    %s\n' "$s"; done
  # workers forked from a process that ran torch deadlock on its locks: fork them from a clean server instead
  printf 'process_isolation = forkserver\npytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -k\n    %s\n' "$deselect"
  printf 'pytest_add_cli_args_test_selection =\n'
  for t in $tests; do if [ -f "$work/$t" ]; then printf "    %s\n" "$t"; fi; done  # a new test file may not exist yet
} >> "$work/setup.cfg"
cd "$work"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # one thread per worker: two cores, two workers
echo "$module: mutating $sources with $(sed -n '/^pytest_add_cli_args_test_selection/,$p' setup.cfg | tail -n +2 | tr -s ' \n' ' ')-k '$deselect'"
nice -n 19 mutmut run "$@" || true
mutmut results --all true > results.txt || true
echo "$module: $(grep -c ': killed' results.txt || true) killed, $(grep -c ': survived' results.txt || true) survived," \
  "$(grep -vc ': killed\|: survived' results.txt || true) other (timeout, no tests, suspicious); list: $work/results.txt"
exit
}
