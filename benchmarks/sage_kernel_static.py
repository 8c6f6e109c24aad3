"""FMHAv2 SAGE kernels compiled for sm_90a on a machine without a GPU: ptxas's registers, spills and GMMA notes per
kernel, and optionally each kernel's SASS.

What a kernel change does to the code can be read before any GPU run: the module's sources (with this package's
header patches) are compiled exactly as the JIT build compiles them, each with ``-Xptxas -v``. ptxas reports the
registers at launch (the compute warpgroups raise theirs with ``setmaxnreg``), the bytes spilled to local memory,
and notes C7519 ("warpgroup.arrive is injected ... to allow use of registers in GMMA": a GMMA waited on before
its registers are reused) and C7511 ("insufficient register resources for the wgmma pipeline": GMMAs serialized).
With ``--sass DIR`` each kernel's SASS goes to ``DIR/<kernel>.sass`` (needs ``cuobjdump`` and ``nvdisasm`` on
``PATH``), where a spill (``LDL``/``STL``) can be placed against the main loop's ``QGMMA`` instructions, and the
table gains the loops' figures (:func:`loop_report`): the spill instructions of the compute warpgroups' KV loop,
and in the DMA warp's KV loop the global loads and whether an inner loop scans for the next step to load (the
tile-map kernels' map scan, ``tile_map_reuse.patch``), and the instructions a computed, kept KV step issues in the
compute warpgroups' KV loop (:func:`kept_step`): on the GPU these kernels issue instructions at about one rate, so
a kernel's time per step follows that count (benchmarks/RESULTS.md). ``--compare OLD_DIR`` says per kernel whether
its SASS equals the one in ``OLD_DIR`` (a ``--sass`` folder of another build, e.g. before a patch) up to code
addresses.

Needs nvcc (CUDA 12.8 or newer) and the cuBLAS headers, which FMHAv2's headers include: ``pip download
nvidia-cublas``, unzip its ``include`` folder and put it on ``CPATH``. Timing still needs the GPU.

    CPATH=.../nvidia/cu13/include python benchmarks/sage_kernel_static.py [--sass sass/] [--kernels skipSoftmax]
        [--compare old_sass/]
"""

import argparse
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

NOTE = re.compile(r"\((C75\d\d)\)")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
KERNEL_SOURCE = re.compile(r"(fmha_v2_flash_attention_\w+)\.cu\b")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.U)?\s+(?:\S+,\s+)?0x([0-9a-f]+)\b")
ADDRESSES = re.compile(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]{16} \*/|0x[0-9a-f]+")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line of ``cuobjdump -sass``'s output."""
    return [(int(m.group(1), 16), m.group(2)) for m in INSTRUCTION.finditer(sass)]


def loops(code: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The bodies of the backward branches' loops, innermost (shortest) first; branches into the out-of-line
    retry blocks at the function's end jump back to a loop's middle and are not loops, so a loop is kept only
    if no shorter loop shares its end."""
    found = []
    for address, op in code:
        target = BRANCH.search(op)
        if target and int(target.group(1), 16) < address and ".DIV" not in op:
            found.append([(a, o) for a, o in code if int(target.group(1), 16) <= a <= address])
    return sorted(found, key=len)


def kept_step(loop: list[tuple[int, str]]) -> int:
    """Instructions issued by one pass through ``loop`` (a loop body, its back branch last) along the path of a
    step that runs its GMMAs and exps and nothing optional: from the loop's head to its back branch, the path with
    the most ``QGMMA``, then the most ``MUFU``, then the fewest instructions (which leaves out a rescale, a skip, a
    map write). A wait succeeds at once: branches out of the loop (to the out-of-line retries) and back within it
    (retry loops) are not taken, nor ``BRA.DIV``; predicated instructions count as issued."""
    if not loop:
        return 0
    at = {address: i for i, (address, _) in enumerate(loop)}
    best: list[tuple[int, int, int] | None] = [None] * len(loop)  # (QGMMA, MUFU, -instructions) to the back branch
    best[-1] = (0, 0, -1)
    for i in range(len(loop) - 2, -1, -1):
        op = loop[i][1]
        target = BRANCH.search(op)
        successors = [] if target and not op.startswith("@") else [i + 1]
        taken = at.get(int(target.group(1), 16), -1) if target and ".DIV" not in op else -1
        if taken > i:
            successors.append(taken)
        paths = [best[j] for j in successors if best[j] is not None]
        if paths:
            gmma, exps, length = max(paths)
            best[i] = (gmma + ("QGMMA" in op), exps + ("MUFU" in op), length - 1)
    return -best[0][2] if best[0] is not None else 0


def loop_report(sass: str) -> dict:
    """Figures of the compute warpgroups' KV loop (the innermost loop with GMMAs) and of the DMA warp's (the
    innermost with TMA loads and no GMMA): spill instructions in the first; global loads in the second, and
    whether it holds an inner loop with global loads and no TMA load (the tile-map kernel's scan of its map for
    the next step to load, ``tile_map_reuse.patch``). And the size of one step's code, comparable across
    kernels: the innermost GMMA loop that masks scores (``FSEL``), the loop over a query tile's last KV step,
    with its ``MUFU`` (exps) and ``PRMT`` (byte permutes) instructions; and :func:`kept_step` of the KV loop
    (the compute warpgroups' time per step follows their instructions, benchmarks/RESULTS.md)."""
    body = loops(instructions(sass))
    compute = next((b for b in body if any("QGMMA" in o for _, o in b)), [])
    last_step = next((b for b in body if any("QGMMA" in o for _, o in b) and any("FSEL" in o for _, o in b)), [])
    dma = next((b for b in body if any("UTMALDG" in o for _, o in b) and not any("QGMMA" in o for _, o in b)), [])
    scan = dma and any(len(b) < len(dma) and dma[0][0] <= b[0][0] and b[-1][0] <= dma[-1][0]
                       and any(re.search(r"\bLDG\b", o) for _, o in b) and not any("UTMALDG" in o for _, o in b)
                       for b in body)
    return dict(loop_qgmma=sum("QGMMA" in o for _, o in compute), kept_step=kept_step(compute),
                loop_spills=sum(bool(re.search(r"\b(?:LDL|STL)\b", o)) for _, o in compute),
                dma_ldg=sum(bool(re.search(r"\bLDG\b", o)) for _, o in dma),
                dma_tma=sum("UTMALDG" in o for _, o in dma), dma_scan=bool(scan), step_loop=len(last_step),
                step_mufu=sum("MUFU" in o for _, o in last_step), step_prmt=sum("PRMT" in o for _, o in last_step))


def same_code(sass: str, other: str) -> bool:
    """Whether two SASS listings hold the same instructions, code addresses and encodings aside."""
    return ADDRESSES.sub("", sass).split() == ADDRESSES.sub("", other).split()


def compile_commands(spec) -> list[tuple[str, list[str]]]:
    """(kernel, nvcc command) for every generated kernel of ``spec``, as its ninja build would run them, with
    ptxas's report on and the object written to a scratch path."""
    spec.write_ninja()
    listed = subprocess.run(["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-t", "commands"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    commands = []
    for line in listed:
        kernel = KERNEL_SOURCE.search(line)
        if "nvcc" not in line or kernel is None:
            continue
        argv = shlex.split(line)
        out = argv.index("-o")
        argv[out + 1] = str(pathlib.Path(spec.build_dir) / f"static_{kernel.group(1)}.o")
        dropped = {"-Xfatbin=-compress-all", "--compress-mode=size"}  # cuobjdump reads uncompressed code only
        commands.append((kernel.group(1), [a for a in argv if a not in dropped] + ["-Xptxas", "-v"]))
    return commands


def report(kernel: str, argv: list[str], sass_dir: pathlib.Path | None,
           compare: pathlib.Path | None = None) -> dict:
    """Compile one kernel; its ptxas figures (and SASS into ``sass_dir`` with :func:`loop_report`'s figures,
    and whether it equals ``compare``'s SASS of the same kernel)."""
    run = subprocess.run(argv, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{kernel}: nvcc failed:\n{run.stderr[-3000:]}")
    entry = run.stderr[run.stderr.index(f"Compiling entry function '{kernel}"):]
    row = dict(kernel=kernel, registers=int(REGISTERS.search(entry).group(1)),
               spill_stores=int(SPILLS.search(entry).group(1)), spill_loads=int(SPILLS.search(entry).group(2)),
               notes=" ".join(sorted(set(NOTE.findall(run.stderr)))))
    if sass_dir is not None:
        obj = argv[argv.index("-o") + 1]
        sass = subprocess.run(["cuobjdump", "-sass", obj], check=True, capture_output=True, text=True).stdout
        (sass_dir / f"{kernel}.sass").write_text(sass)
        row["qgmma"], row["spill_instructions"] = sass.count("QGMMA"), len(re.findall(r"\b(?:LDL|STL)\b", sass))
        row.update(loop_report(sass))
        if compare is not None:
            old = compare / f"{kernel}.sass"
            row["same_sass"] = same_code(sass, old.read_text()) if old.exists() else "absent"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", type=pathlib.Path, help="write each kernel's SASS into this folder")
    parser.add_argument("--kernels", default="", help="only kernels whose name contains this text")
    parser.add_argument("--compare", type=pathlib.Path,
                        help="with --sass: compare each kernel's SASS with this folder's (another build's --sass)")
    args = parser.parse_args()
    if args.compare and not args.sass:
        parser.error("--compare needs --sass")
    missing = [tool for tool in ("nvcc", "ninja") + (("cuobjdump", "nvdisasm") if args.sass else ())
               if shutil.which(tool) is None]
    if missing:
        print(f"sage_kernel_static: {', '.join(missing)} not found on PATH; the build needs nvcc and ninja, "
              "--sass also cuobjdump and nvdisasm", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # no GPU to read the arch from
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from diffusers_trtllm.kernels import fmha_v2_sage

    commands = [(k, argv) for k, argv in compile_commands(fmha_v2_sage.jit_spec()) if args.kernels in k]
    if not commands:
        print(f"sage_kernel_static: --kernels {args.kernels!r} matches none of the module's kernels", file=sys.stderr)
        sys.exit(2)
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        rows = list(tqdm(pool.map(lambda c: report(*c, args.sass, args.compare), commands), total=len(commands),
                         desc="nvcc sm_90a", unit="kernel"))
    columns = ["kernel", "registers", "spill_stores", "spill_loads", "notes"] + (
        ["qgmma", "spill_instructions", "loop_qgmma", "loop_spills", "kept_step", "dma_ldg", "dma_tma", "dma_scan",
         "step_loop", "step_mufu", "step_prmt"]
        if args.sass else []) + (["same_sass"] if args.compare else [])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in sorted(rows, key=lambda r: r["kernel"]):
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
