"""The stand-in pair's training corpus: the `.py` source of pinned PyPI packages, rebuilt offline.

The manifest (data/corpus/manifest.json) is the single source of truth: which packages, at which
version, under which file filter, in which split, and what the result must hash to. `build`
reads the files either from wheels that pip downloads (a CPU machine with PyPI) or from an
installed site-packages (the GPU host, which has no network but has these packages preinstalled),
and checks every package's file count and sha256 against the manifest.

The split is by whole package: a held-out package is never trained on (neither by the tokenizer
nor by the models). Packages share near-duplicate code across their own files, so a split by file
would leak.

Hashing (manifest "hash_scheme"): packages in manifest order, files in sorted path order; each file
contributes  path + "\\n" + text + "\\0"  (UTF-8). A package's sha256 covers its own files, a split's
its packages', and the corpus sha256 every package's.

    python -m kdtree_lib.corpus build --out data/corpus/build                       # wheels via pip
    python -m kdtree_lib.corpus build --out data/corpus/build --from-site-packages  # installed copies
    python -m kdtree_lib.corpus prompts --build data/corpus/build                   # held-out prompt file
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import json
import random
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from . import cli
from .paths import CORPUS_DIR

MANIFEST_PATH = CORPUS_DIR / "manifest.json"
PROMPTS_PATH = CORPUS_DIR / "heldout_prompts.jsonl"
SPLITS = ("train", "heldout")
HASH_SCHEME = "sha256 over packages in manifest order, files in sorted path order, each path + '\\n' + text + '\\0'"
# pure-python wheels install anywhere; these flags only stop pip from choosing by the local interpreter
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
              "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


# ----------------------------------------------------------------------------------------------
# manifest

@dataclass(frozen=True)
class FileFilter:
    """Which files of a package enter the corpus (the same rule for every package)."""
    suffix: str = ".py"
    exclude_dirs: tuple[str, ...] = ("tests", "test", "benchmarks")
    max_bytes: int = 524288  # larger .py files are generated tables, not code

    def accepts(self, path: str, size: int) -> bool:
        parts = PurePosixPath(path).parts
        return (path.endswith(self.suffix) and size <= self.max_bytes
                and not any(".dist-info" in part or part.endswith(".data") or part == ".." for part in parts)
                and not any(part in self.exclude_dirs for part in parts[:-1]))

    def to_dict(self) -> dict:
        return {"suffix": self.suffix, "exclude_dirs": list(self.exclude_dirs), "max_bytes": self.max_bytes,
                "encoding": "utf-8 (files that do not decode are skipped)",
                "normalize": "BOM removed, CRLF/CR -> LF; files empty after that are skipped"}


@dataclass(frozen=True)
class Package:
    """One pinned distribution and its place in the corpus."""
    name: str                       # distribution name as on PyPI
    version: str
    split: str                      # "train" or "heldout"
    select: tuple[str, ...] = ()    # "+prefix" / "-prefix" path rules; the longest match decides
    files: int | None = None        # measured: the files that pass the filter
    bytes: int | None = None        # measured: UTF-8 bytes of their normalized text
    sha256: str | None = None       # measured

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"

    def wanted(self, path: str) -> bool:
        """Every file unless a select rule says otherwise; the longest matching prefix decides."""
        matches = [(len(rule) - 1, rule[0]) for rule in self.select if path.startswith(rule[1:])]
        return max(matches)[1] == "+" if matches else True


@dataclass(frozen=True)
class Manifest:
    packages: tuple[Package, ...]
    file_filter: FileFilter
    sha256: str | None = None

    @classmethod
    def load(cls, path: Path = MANIFEST_PATH) -> "Manifest":
        raw = json.loads(Path(path).read_text())
        flt = raw["filter"]
        file_filter = FileFilter(suffix=flt["suffix"], exclude_dirs=tuple(flt["exclude_dirs"]),
                                 max_bytes=int(flt["max_bytes"]))
        packages = []
        for entry in raw["packages"]:
            if entry["split"] not in SPLITS:
                raise ValueError(f"manifest: package {entry['name']}: split must be one of {SPLITS}, "
                                 f"got {entry['split']!r}")
            select = tuple(entry.get("select", ()))
            if any(rule[:1] not in ("+", "-") for rule in select):
                raise ValueError(f"manifest: package {entry['name']}: select rules start with + or -, got {select}")
            packages.append(Package(name=entry["name"], version=entry["version"], split=entry["split"],
                                    select=select, files=entry.get("files"),
                                    bytes=entry.get("bytes"), sha256=entry.get("sha256")))
        names = [p.name for p in packages]
        if len(set(names)) != len(names):
            raise ValueError(f"manifest: a package is listed twice in {names}")
        return cls(packages=tuple(packages), file_filter=file_filter, sha256=raw.get("sha256"))

    def split_packages(self, split: str) -> list[Package]:
        return [p for p in self.packages if p.split == split]


def manifest_dict(manifest: Manifest, built: list["PackageText"]) -> dict:
    """The manifest file's content with the measured counts and hashes of `built` filled in."""
    measured = {b.package.name: b for b in built}
    packages, splits = [], {}
    for package in manifest.packages:
        b = measured[package.name]
        entry = {"name": package.name, "version": package.version, "split": package.split}
        if package.select:
            entry["select"] = list(package.select)
        entry.update(files=len(b.documents), bytes=b.n_bytes, sha256=b.sha256)
        packages.append(entry)
    for split in SPLITS:
        members = [measured[p.name] for p in manifest.split_packages(split)]
        splits[split] = {"packages": [b.package.name for b in members],
                         "files": sum(len(b.documents) for b in members),
                         "bytes": sum(b.n_bytes for b in members),
                         "sha256": combined_sha256(members)}
    return {"description": "Training corpus of the stand-in pair: .py source of pinned PyPI "
                           "packages, split by whole package.",
            "rebuild": ["python -m kdtree_lib.corpus build --out data/corpus/build",
                        "python -m kdtree_lib.corpus build --out data/corpus/build --from-site-packages"],
            "hash_scheme": HASH_SCHEME,
            "filter": manifest.file_filter.to_dict(),
            "select_rules": "per package, '+prefix' / '-prefix' on the path; the longest matching prefix decides",
            "packages": packages,
            "splits": splits,
            "files": sum(s["files"] for s in splits.values()),
            "bytes": sum(s["bytes"] for s in splits.values()),
            "sha256": combined_sha256([measured[p.name] for p in manifest.packages])}


# ----------------------------------------------------------------------------------------------
# reading one package

@dataclass
class PackageText:
    """A package's corpus documents: (path, normalized text), sorted by path."""
    package: Package
    documents: list[tuple[str, str]]
    skipped: int  # files that passed the filter but did not decode or were empty

    def digest_into(self, sha) -> None:
        for path, text in self.documents:
            sha.update(path.encode() + b"\n" + text.encode() + b"\0")

    @property
    def sha256(self) -> str:
        sha = hashlib.sha256()
        self.digest_into(sha)
        return sha.hexdigest()

    @property
    def n_bytes(self) -> int:
        return sum(len(text.encode()) for _, text in self.documents)


def combined_sha256(texts: list[PackageText]) -> str:
    sha = hashlib.sha256()
    for text in texts:
        text.digest_into(sha)
    return sha.hexdigest()


def normalize(raw: bytes) -> str | None:
    """The file's text with a uniform encoding and line ends; None if it is not UTF-8 or empty."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return text if text.strip() and "\0" not in text else None


def collect(package: Package, file_filter: FileFilter, entries) -> PackageText:
    """Filter and normalize `entries`, an iterable of (path, size, read() -> bytes)."""
    documents, skipped = [], 0
    for path, size, read in sorted(entries, key=lambda entry: entry[0]):
        if not (file_filter.accepts(path, size) and package.wanted(path)):
            continue
        text = normalize(read())
        if text is None:
            skipped += 1
        else:
            documents.append((path, text))
    return PackageText(package=package, documents=documents, skipped=skipped)


def wheel_entries(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    return [(info.filename, info.file_size, lambda info=info: archive.read(info))
            for info in archive.infolist() if not info.is_dir()]


def site_entries(package: Package, site_packages: list[str] | None):
    """The installed distribution's files (from its RECORD), if its version is the pinned one."""
    search = {"path": site_packages} if site_packages else {}
    found = [d for d in metadata.distributions(**search)
             if normalized_name(d.metadata["Name"]) == normalized_name(package.name)]
    if not found:
        raise LookupError(f"{package.name} is not installed")
    dist = found[0]
    if dist.version != package.version:
        raise LookupError(f"{package.name} {dist.version} is installed, the manifest pins {package.version}")
    entries = []
    for record in dist.files or ():
        path = Path(dist.locate_file(record))
        if path.is_file():
            entries.append((str(PurePosixPath(*record.parts)), path.stat().st_size,
                            lambda path=path: path.read_bytes()))
    return entries


def normalized_name(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def download_wheel(package: Package, wheels_dir: Path) -> Path:
    """The package's wheel in `wheels_dir`, fetched with `pip download --no-deps` if absent."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    stem = normalized_name(package.name).replace("-", "_")
    pattern = f"{stem}-{package.version}-*.whl"

    def present():
        return sorted(w for w in wheels_dir.iterdir() if fnmatch.fnmatch(w.name.lower(), pattern.lower()))

    if not present():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        *PIP_TARGET, "-d", str(wheels_dir), package.pin], check=True)
    wheels = present()
    if not wheels:
        raise LookupError(f"pip downloaded no wheel named {pattern} for {package.pin}")
    return wheels[0]


# ----------------------------------------------------------------------------------------------
# the build

def read_packages(manifest: Manifest, *, site_packages: list[str] | None = None, from_site: bool = False,
                  wheels_dir: Path | None = None) -> list[PackageText]:
    """Every manifest package's documents, from site-packages or from downloaded wheels.

    From site-packages, all version mismatches are reported together before anything is read.
    """
    if from_site:
        problems, entries = [], {}
        for package in manifest.packages:
            try:
                entries[package.name] = site_entries(package, site_packages)
            except LookupError as err:
                problems.append(str(err))
        if problems:
            raise LookupError("site-packages does not hold the pinned versions: " + "; ".join(problems)
                              + ". Build from wheels on a machine with PyPI and carry the build folder.")
        return [collect(p, manifest.file_filter, entries[p.name]) for p in manifest.packages]
    if wheels_dir is None:
        raise ValueError("wheels_dir: needed when not reading from site-packages")
    return [collect(p, manifest.file_filter, wheel_entries(download_wheel(p, wheels_dir)))
            for p in manifest.packages]


def verify(manifest: Manifest, built: list[PackageText]) -> list[str]:
    """Differences between the built packages and the manifest's measured values (empty = identical)."""
    problems = []
    pinned = {p.name: p for p in manifest.packages}
    for b in built:
        p = pinned[b.package.name]
        if p.sha256 is None:
            problems.append(f"{p.pin}: the manifest has no measured sha256 (run build --update-manifest)")
        elif (len(b.documents), b.sha256) != (p.files, p.sha256):
            problems.append(f"{p.pin}: {len(b.documents)} files sha256 {b.sha256[:12]}…, "
                            f"manifest {p.files} files sha256 {p.sha256[:12]}…")
    if not problems and manifest.sha256 != combined_sha256(built):
        problems.append(f"corpus sha256 {combined_sha256(built)[:12]}… differs from the manifest's")
    return problems


def write_build(out: Path, built: list[PackageText], source: str) -> None:
    """corpus-<split>.jsonl (one {"package", "path", "text"} per file), files.csv and build.json."""
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        with open(out / f"corpus-{split}.jsonl", "w", encoding="utf-8") as f:
            for b in built:
                if b.package.split == split:
                    for path, text in b.documents:
                        f.write(json.dumps({"package": b.package.name, "path": path, "text": text}) + "\n")
    with open(out / "files.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["package", "version", "split", "path", "bytes", "lines"])
        for b in built:
            for path, text in b.documents:
                writer.writerow([b.package.name, b.package.version, b.package.split, path,
                                 len(text.encode()), text.count("\n")])
    summary = {"source": source, "sha256": combined_sha256(built),
               "packages": {b.package.name: {"version": b.package.version, "split": b.package.split,
                                             "files": len(b.documents), "bytes": b.n_bytes,
                                             "skipped": b.skipped, "sha256": b.sha256} for b in built}}
    (out / "build.json").write_text(json.dumps(summary, indent=1) + "\n")


def read_documents(build_dir, split: str):
    """Yield the text of every file of one split of a build, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    path = Path(build_dir) / f"corpus-{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m kdtree_lib.corpus build --out {build_dir}`")
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def heldout_prompts(build_dir, count: int, chars: int, seed: int) -> list[dict]:
    """`count` excerpts of about `chars` characters from distinct held-out files, each starting and
    ending at a line boundary (the prompts of the acceptance measurements, committed so that the
    notebooks need no corpus build)."""
    path = Path(build_dir) / "corpus-heldout.jsonl"
    with open(path, encoding="utf-8") as f:
        files = [json.loads(line) for line in f]
    files = [f for f in files if len(f["text"]) >= 2 * chars]
    if len(files) < count:
        raise ValueError(f"count: only {len(files)} held-out files hold {2 * chars} characters")
    rng = random.Random(seed)
    prompts = []
    for entry in sorted(rng.sample(files, count), key=lambda e: (e["package"], e["path"])):
        text = entry["text"]
        start = text.find("\n", rng.randrange(len(text) - chars)) + 1
        end = text.rfind("\n", start, start + chars) + 1
        prompts.append({"package": entry["package"], "path": entry["path"], "start": start,
                        "text": text[start:end]})
    return prompts


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="rebuild the corpus and check it against the manifest")
    build.add_argument("--out", type=Path, required=True, help="build folder (git-ignored)")
    build.add_argument("--manifest", type=Path, default=MANIFEST_PATH)
    build.add_argument("--from-site-packages", action="store_true",
                       help="read the installed distributions instead of downloading wheels")
    build.add_argument("--site-packages", action="append",
                       help="folder to look for installed distributions (repeatable; default sys.path)")
    build.add_argument("--wheels", type=Path, help="wheel cache (default OUT/wheels)")
    build.add_argument("--update-manifest", action="store_true",
                       help="write the measured counts and hashes into the manifest instead of checking them")
    prompts = sub.add_parser("prompts", help="write held-out prompt excerpts for the acceptance measurements")
    prompts.add_argument("--build", type=Path, required=True, help="a corpus build folder")
    prompts.add_argument("--out", type=Path, default=PROMPTS_PATH)
    prompts.add_argument("--count", type=cli.positive_int, default=64)
    prompts.add_argument("--chars", type=cli.positive_int, default=1200)
    prompts.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "prompts":
        chosen = heldout_prompts(args.build, args.count, args.chars, args.seed)
        args.out.write_text("".join(json.dumps(p) + "\n" for p in chosen))
        print(f"{len(chosen)} prompts from {len({p['package'] for p in chosen})} held-out packages -> {args.out}")
        return 0
    manifest = Manifest.load(args.manifest)
    try:
        built = read_packages(manifest, site_packages=args.site_packages, from_site=args.from_site_packages,
                              wheels_dir=args.wheels or args.out / "wheels")
    except LookupError as err:
        raise cli.Refused(str(err)) from None
    source = "site-packages" if args.from_site_packages else "wheels"
    for b in built:
        print(f"{b.package.split:8s} {b.package.pin:32s} {len(b.documents):5d} files "
              f"{b.n_bytes / 1e6:7.2f} MB  sha256 {b.sha256[:16]}")
    if args.update_manifest:
        args.manifest.write_text(json.dumps(manifest_dict(manifest, built), indent=1) + "\n")
        print(f"wrote measured values to {args.manifest}")
    else:
        problems = verify(manifest, built)
        if problems:
            print("corpus differs from the manifest:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
    write_build(args.out, built, source)
    print(f"corpus sha256 {combined_sha256(built)} ({source}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
