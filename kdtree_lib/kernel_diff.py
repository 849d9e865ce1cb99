"""Did an edit of kernels/ change what the GPU runs? Every kernel of every kernels/*.cu file, built by nvcc
(`cuda.nvcc_compile`, the flags CI's compile checks use) for each architecture it targets, from this tree and
from a git commit, compared kernel by kernel: the SASS (`cuobjdump -sass`, instruction addresses and
encodings stripped) and ptxas' registers, spills and static shared memory (`cuda.ptxas_report`).

    python -m kdtree_lib.kernel_diff --base main [--files moe_int4.cu verify_attn.cu] [--jobs 2]

One line per (file, architecture): `identical`, or each kernel that differs with the start of its SASS diff
(`--context` lines). Exit status 0 when every build is identical, 1 when anything differs, 2 when the command
is refused (no nvcc or cuobjdump, a base that is not a commit). A move of helpers between headers that leaves
every line identical changed nothing a GPU can see: same instructions in the same order, same resources. A
kernel whose instructions are the same but whose scheduling control words differ is reported as such
(`control bits`): the arithmetic is the same, the issue timing may not be.

Architectures: sm_90 and sm_120 (`cuda.ARCHITECTURES`) for every file, sm_90a alone for the wgmma kernel
(`verify_attn.KERNEL_FILE_SM90A`, which refuses any other target). cuobjdump ships with the CUDA toolkit
(`nvidia-cuda-cuobjdump` on PyPI for a toolkit without it); it is looked up on PATH, then beside nvcc.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import cli, cuda
from .paths import KERNEL_DIR, REPO_ROOT

ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")           # /*0a10*/: the instruction's offset
ENCODING = re.compile(r"/\*\s*0x[0-9a-f]{16}\s*\*/")  # /* 0x000fe20000000800 */: encoding and control word
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")


def architectures(file_name: str) -> tuple[str, ...]:
    """The targets a kernel file is built for: sm_90a alone for the wgmma kernel, else sm_90 and sm_120."""
    from .verify_attn import KERNEL_FILE_SM90A
    return ("sm_90a",) if file_name == KERNEL_FILE_SM90A else cuda.ARCHITECTURES


def cuobjdump() -> str:
    """The cuobjdump executable: on PATH, else in the bin folder of the nvcc that PATH finds."""
    found = shutil.which("cuobjdump")
    nvcc = shutil.which("nvcc")
    if found is None and nvcc is not None:
        found = shutil.which("cuobjdump", path=str(Path(os.path.realpath(nvcc)).parent))
    if found is None:
        raise FileNotFoundError("cuobjdump: not found on PATH nor beside nvcc (it ships with the CUDA toolkit; "
                                "pip's nvidia-cuda-cuobjdump has one)")
    return found


@dataclass(frozen=True)
class Sass:
    """One kernel's SASS: its instructions as text (no addresses, no encodings, spaces folded) and its
    encoded words (the instruction and its scheduling control word, in order)."""
    instructions: tuple[str, ...]
    words: tuple[str, ...]


def parse_sass(text: str) -> dict[str, Sass]:
    """{kernel: Sass} from `cuobjdump -sass` output of one cubin."""
    kernels: dict[str, tuple[list, list]] = {}
    current = None
    for line in text.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match[1], ([], []))
            continue
        if current is None or line.lstrip().startswith("."):  # before the first function, or .headerflags
            continue
        current[1].extend(word.strip("/* ") for word in ENCODING.findall(line))
        instruction = " ".join(ENCODING.sub("", ADDRESS.sub("", line)).split())
        if instruction:
            current[0].append(instruction)
    return {name: Sass(tuple(instructions), tuple(words)) for name, (instructions, words) in kernels.items()}


def sass(cubin: Path) -> dict[str, Sass]:
    done = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True)
    if done.returncode != 0:
        # a missing nvdisasm (cuobjdump calls it for -sass) lands here: one line, no traceback
        raise cli.Refused(f"cuobjdump failed on {cubin}: {' '.join(done.stderr.split())}")
    return parse_sass(done.stdout)


@dataclass(frozen=True)
class Build:
    """One nvcc build of one kernel file for one architecture: each kernel's SASS and resources."""
    sass: dict[str, Sass]
    resources: dict[str, cuda.KernelResources]


def build(kernel_dir: Path, file_name: str, arch: str, out_dir: Path) -> Build:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = cuda.ptxas_report(file_name, arch, out_dir, kernel_dir=kernel_dir)
    return Build(sass(out_dir / f"{Path(file_name).stem}.{arch}.cubin"), report.kernels)


@dataclass
class Comparison:
    """One (file, architecture): how many kernels, and for each kernel that differs what differs."""
    file_name: str
    arch: str
    kernels: int = 0
    differences: dict[str, list[str]] = field(default_factory=dict)  # kernel -> lines saying how

    @property
    def identical(self) -> bool:
        return not self.differences


def compare_builds(base: Build, head: Build, *, context: int = 3) -> dict[str, list[str]]:
    """{kernel: lines} for every kernel whose SASS or resources differ between two builds (a kernel in one
    build only included)."""
    differences = {}
    for name in sorted(set(base.sass) | set(head.sass) | set(base.resources) | set(head.resources)):
        lines = []
        if name not in head.sass or name not in base.sass:
            lines.append("only in " + ("the base" if name in base.sass else "this tree"))
        else:
            old, new = base.sass[name], head.sass[name]
            if old.instructions != new.instructions:
                diff = list(difflib.unified_diff(old.instructions, new.instructions, "base", "this tree",
                                                 lineterm="", n=context))[2:]  # without the ---/+++ header
                lines.append(f"SASS: {len(old.instructions)} -> {len(new.instructions)} instructions, "
                             f"{sum(d[:1] in '+-' for d in diff)} lines of diff; {moved_only(diff)}")
                lines += diff[:12 * (context + 1)]
            elif old.words != new.words:
                changed = sum(a != b for a, b in zip(old.words, new.words))
                lines.append(f"control bits: same instructions, {changed} encoded words differ (scheduling)")
        if base.resources.get(name) != head.resources.get(name):
            lines.append(f"ptxas: {base.resources.get(name)} -> {head.resources.get(name)}")
        if lines:
            differences[name] = lines
    return differences


def opcode(instruction: str) -> str:
    """`BAR.SYNC.DEFER_BLOCKING` of `@P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;`: the instruction without its guard
    predicate and operands."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def moved_only(diff: list[str]) -> str:
    """What a SASS diff (unified, without its header) changes: `reordered only` when the lines it removes
    are the lines it adds (the same instructions with the same registers and operands, some of them
    elsewhere; the arithmetic each performs is unchanged, what moved is named), else `instructions
    differ`."""
    removed = Counter(d[1:] for d in diff if d.startswith("-"))
    added = Counter(d[1:] for d in diff if d.startswith("+"))
    if removed != added:
        return "instructions differ"
    moved = Counter(opcode(line) for line in removed.elements())
    return ("reordered only (the same instructions and operands), moved: "
            + ", ".join(f"{name} x{count}" for name, count in sorted(moved.items())))


def checkout_kernels(base: str, dest: Path) -> Path:
    """The kernels/ folder of git commit `base` written under dest; returns that folder."""
    def git(*args) -> str:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ValueError(f"base: git {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    commit = git("rev-parse", "--verify", "--quiet", f"{base}^{{commit}}").strip()
    folder = dest / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    for path in git("ls-tree", "-r", "--name-only", commit, "--", "kernels/").splitlines():
        data = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{commit}:{path}"], capture_output=True,
                              check=True).stdout
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)
    return folder


def compare_dirs(base_dir: Path, head_dir: Path, files=None, *, jobs: int = 2, context: int = 3,
                 work_dir: Path | None = None, progress: bool = True) -> list[Comparison]:
    """Compare the builds of two kernel folders: `files` (default: every .cu in either), each for its
    architectures. A file in one folder only is one Comparison saying so."""
    if files is None:
        files = sorted({p.name for d in (base_dir, head_dir) for p in Path(d).glob("*.cu")})
    for name in files:
        if not ((Path(base_dir) / name).is_file() or (Path(head_dir) / name).is_file()):
            raise ValueError(f"files: {name} is a kernel file of neither tree")
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="kernel_diff.") as tmp:
            return compare_dirs(base_dir, head_dir, files, jobs=jobs, context=context, work_dir=Path(tmp),
                                progress=progress)
    jobs_list = [(name, arch) for name in files for arch in architectures(name)]

    def one(job) -> Comparison:
        name, arch = job
        result = Comparison(name, arch)
        present = [(Path(d) / name).is_file() for d in (base_dir, head_dir)]
        if not all(present):
            result.differences[name] = ["the file is only in " + ("the base" if present[0] else "this tree")]
            return result
        base = build(Path(base_dir), name, arch, work_dir / "base")
        head = build(Path(head_dir), name, arch, work_dir / "head")
        result.kernels = len(head.sass)
        result.differences = compare_builds(base, head, context=context)
        return result

    from tqdm.auto import tqdm
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each job waits on nvcc and cuobjdump processes
        results = list(tqdm(pool.map(one, jobs_list), total=len(jobs_list), desc="nvcc builds", unit="build",
                            file=sys.stderr, disable=not progress))
    return results


def compare(base: str, files=None, *, jobs: int = 2, context: int = 3, progress: bool = True) -> list[Comparison]:
    """Compare this tree's kernels/ with git commit `base`'s."""
    cuobjdump()  # refuse before building anything
    with tempfile.TemporaryDirectory(prefix="kernel_diff.") as tmp:
        base_dir = checkout_kernels(base, Path(tmp) / "base_tree")
        return compare_dirs(base_dir, KERNEL_DIR, files, jobs=jobs, context=context, work_dir=Path(tmp) / "builds",
                            progress=progress)


def report(results: list[Comparison]) -> str:
    lines = []
    for r in results:
        if r.identical:
            lines.append(f"{r.file_name} {r.arch}: identical ({r.kernels} kernels: SASS and ptxas resources)")
            continue
        lines.append(f"{r.file_name} {r.arch}: {len(r.differences)} of {r.kernels} kernels differ")
        for kernel, how in r.differences.items():
            lines.append(f"  {kernel}:")
            lines += [f"    {line}" for line in how]
    return "\n".join(lines)


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git commit to compare with (a hash, a branch, HEAD~1)")
    parser.add_argument("--files", nargs="+", default=None, help="kernel files (default: every kernels/*.cu)")
    parser.add_argument("--jobs", type=cli.positive_int, default=2, help="builds at once")
    parser.add_argument("--context", type=cli.nonnegative_int, default=3, help="SASS diff context lines")
    args = parser.parse_args(argv)
    results = compare(args.base, args.files, jobs=args.jobs, context=args.context)
    print(report(results))
    return 0 if all(r.identical for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
