"""benchmarks/plot_results.py: the plots are drawn from RESULTS.md's own tables, with the numbers they hold."""

import subprocess
import sys

from helpers import load_script

plots = load_script("benchmarks/plot_results.py")

TABLES = """# Results

#### Wan 2.2 A14B: 1280×720, 81 frames, CFG, 40 steps

| configuration | text encoding (s) | denoising / step (s) | denoising, 40 steps (s) | VAE decode (s) | seconds per video | × best diffusers | notes |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |
| diffusers default processors | 0.09 | 22.51 | 900.3 | 7.5 | 907.8 | 1.000× |  |
| TRTLLM_ATTN SAGE fp8 | 0.11 | 16.64 | 665.6 | 7.5* | 673.2 | 1.348× |  |

#### HunyuanVideo 1.5: 1280×720, 81 frames, CFG, 50 steps

| configuration | text encoding (s) | denoising / step (s) | denoising, 50 steps (s) | VAE decode (s) | seconds per video | × best diffusers | notes |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |
| diffusers default processors | 0.13 | 31.66 | 1,583.1 | 11.8 | 1,595.0 | 1.000× |  |
| diffusers backend flash | n/a | n/a | n/a | n/a | n/a | n/a | refused: not installed |

### The published-curve table and more

| s | sparsity | FMHAv2 bf16 + skip | **FMHAv2 SAGE fp8 + skip** (k0, 256) | k64, 256 |
|---|---|---|---|---|
| 0.30 | 0.31 | 186.6, 1.09× | **122.9, 1.65×** | 137.2, 1.48× |
| 0.65 | 0.66 | 145.7, 1.39× | **99.5, 2.04×** | 108.4, 1.87× |

### Reuse against sparsity: FMHAv2 SAGE fp8

| s | sparsity | SAGE fp8 | **SAGE fp8 + reuse** | SAGE fp8 + reuse window (first + 2) |
|---|---|---|---|---|
| 0.50 | 0.49 | 124.7, 1.58× | **81.5, 2.41×** | 92.3, 2.13× |
| 0.75 | 0.84 | 124.7, 1.58× | **30.7, 6.41×** | 51.4, 3.83× |
"""


def test_the_video_plot_reads_every_configuration_that_ran_and_its_phases():
    models = plots.video_phases(TABLES)
    assert models["Wan 2.2 A14B"][1] == ("TRTLLM_ATTN SAGE fp8",
                                         {"text encoding": 0.11, "denoising": 665.6, "VAE decode": 7.5}, 1.348)
    # a refused backend (n/a) is left out; thousands separators are read
    assert models["HunyuanVideo 1.5"] == [("diffusers default processors",
                                           {"text encoding": 0.13, "denoising": 1583.1, "VAE decode": 11.8}, 1.0)]


def test_the_curve_plot_reads_each_kernels_ratio_and_names_the_block_variants():
    s_values, curves = plots.speed_curves(TABLES, plots.CURVES["skip_curve"][0])
    assert s_values == [0.3, 0.65]
    assert curves == {"FMHAv2 bf16 + skip": [1.09, 1.39],
                      "FMHAv2 SAGE fp8 + skip (K scale per sequence and head, 256-key steps)": [1.65, 2.04],
                      "FMHAv2 SAGE fp8 + skip (K scale per 64 keys, 256-key steps)": [1.48, 1.87]}


def test_the_reuse_curve_reads_its_own_table_and_keeps_a_columns_parenthesis():
    s_values, curves = plots.speed_curves(TABLES, plots.CURVES["reuse_curve"][0])
    assert s_values == [0.5, 0.75]
    assert curves == {"SAGE fp8": [1.58, 1.58], "SAGE fp8 + reuse": [2.41, 6.41],
                      "SAGE fp8 + reuse window (first + 2)": [2.13, 3.83]}


def test_the_plots_of_the_repositorys_results_are_written(tmp_path):
    written = plots.main(["--out", str(tmp_path)])
    assert set(written) == {"seconds_per_video", "skip_curve", "reuse_curve"}
    for path in written.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_a_results_file_without_the_tables_is_one_line_and_status_2(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nnothing yet\n")
    proc = subprocess.run([sys.executable, "benchmarks/plot_results.py", "--results", str(results), "--out",
                           str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "no heading starting '#### Wan 2.2 A14B'" in proc.stderr
