#!/usr/bin/env python3
"""Build each pull request's prefix of the patch series and run its topic's tests (docs/upstreaming.md, "The PRs").

The series is ordered as upstream would merge it: standalone fixes, then S3D8 (CPU), then mllama, then the KV-cache
types, the two CPU kernels and S3D8 on Vulkan. ``ggml-patches/series`` groups it by PR (a ``# PR <name>: <title>``
header above each PR's patches, ``ci/patches.py``); this script applies each prefix of the series that ends a PR to a
fresh copy of the pin, builds it with the host preset's settings
(the tools and upstream's own test suite; this project's C tests need the whole series and are left to ``ci/test.sh``)
and runs upstream's suite (label ``main``, less the network checks of the ``upstream`` test preset) plus the PR's
own checks. CI does not run it (one build per PR); run it before proposing the PRs:

    python3 ci/check_prs.py                 # every PR's prefix (one tree and build folder, rebuilt incrementally)
    python3 ci/check_prs.py --only s3d8     # one of them
    python3 ci/check_prs.py --full          # also upstream's two all-architecture state tests (~12 min more each)

It fails (exit 1) when ``series`` has a PR without patches, ``CHECKS`` or ``VULKAN`` name a PR that ``series`` lacks,
or a prefix does not apply, build or pass.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import patches  # noqa: E402
import upstream  # noqa: E402

REPO = upstream.REPO_ROOT


@dataclass(frozen=True)
class PR:
    name: str  # the name in its ``# PR <name>: <title>`` header in series
    title: str
    checks: tuple[tuple[str, ...], ...] = ()  # extra commands, run in the build's bin/ folder
    vulkan: bool = False  # build ggml-vulkan too (its checks run on the first Vulkan device: lavapipe here)


#: each PR's own checks beyond upstream's suite (commands run in the build's bin/ folder), by its name in series
CHECKS: dict[str, tuple[tuple[str, ...], ...]] = {
    # the type, its kernels, gguf-py, llama-quantize and the tests, then GPTQ for S3D8 in C (their own tests,
    # tests/python/test_gptq_c.py, are ci/test.sh's)
    "s3d8": (("./test-backend-ops", "test", "-b", "CPU", "-p", "s3d8"),),
    # the CPU flash-attention kernel for long, short-headed attention (the mllama vision encoder)
    "cpu-fa": (("./test-backend-ops", "test", "-o", "FLASH_ATTN_EXT", "-b", "CPU", "-p", "nb=600"),),
    # the vector GELU (erf) of the CPU backend (the same encoder's MLP)
    "cpu-gelu": (("./test-backend-ops", "test", "-o", "GELU_ERF", "-b", "CPU"),),
    # S3D8 on ggml-vulkan (docs/gpu.md): the headers guard, the shaders and ops, the odd-slice test cases
    # one process per op: all 44 cases in one abort on lavapipe 22.3.6 about one run in two (docs/gpu.md)
    "vulkan-s3d8": tuple(("env", "GGML_VK_VISIBLE_DEVICES=0", "./test-backend-ops", "test", "-b", "Vulkan0", "-o", op,
                          "-p", "s3d8") for op in ("MUL_MAT", "MUL_MAT_ID", "GET_ROWS")),
}
#: the PRs built with GGML_VULKAN=ON
VULKAN = frozenset({"vulkan-s3d8"})
UPSTREAM_TOOLS = ("llama-cli", "llama-mtmd-cli", "llama-server", "llama-quantize", "llama-bench", "llama-perplexity",
                  "llama-imatrix", "llama-tokenize")
#: upstream's tests that cover every architecture's state save/restore (~9 min together on 2 cores): --full only
LONG_TESTS = ("test-save-load-state", "test-recurrent-state-rollback")


def subject(patch: Path) -> str:
    """The patch's subject (an email header: a long one continues on lines that start with a space)."""
    lines = patch.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject: "):
            text = line[len("Subject: "):]
            for more in lines[i + 1:]:
                if not more.startswith((" ", "\t")):
                    break
                text += more  # unfolding keeps the continuation's leading space
            return text.removeprefix("[PATCH] ")
    raise patches.PatchError(f"{patch.name}: no Subject line")


def prefixes(patch_dir: Path = patches.PATCH_DIR) -> list[tuple[PR, list[Path]]]:
    """Each PR of ``series`` (in order) with the series' prefix that ends with its last patch."""
    groups = patches.groups(patch_dir)
    names = [g.name for g, _ in groups]
    for what, keys in (("CHECKS", set(CHECKS)), ("VULKAN", set(VULKAN))):
        unknown = sorted(keys - set(names))
        if unknown:
            raise patches.PatchError(f"{what} in ci/check_prs.py names PRs that {patches.SERIES_FILE} does not have: "
                                     f"{', '.join(unknown)}")
    out: list[tuple[PR, list[Path]]] = []
    done: list[Path] = []
    for g, files in groups:
        if not files:
            raise patches.PatchError(f"PR {g.name} has no patches in {patches.SERIES_FILE}: remove its header")
        done = done + files
        out.append((PR(g.name, g.title, CHECKS.get(g.name, ()), g.name in VULKAN), done))
    return out


def ctest_exclusions() -> str:
    presets = json.loads((REPO / "CMakePresets.json").read_text())
    [up] = [p for p in presets["testPresets"] if p["name"] == "upstream"]
    return up["filter"]["exclude"]["name"]


def run(cmd: list[str], cwd: Path | None = None) -> bool:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=cwd).returncode == 0


#: one tree and one build folder for every prefix, at fixed paths: a prefix rebuilds only what its patches change
#: (ninja), and a second run of the script hits ccache (whose keys hold the source paths)
PR_TREE = REPO / "work" / "pr-check" / "llama.cpp"
PR_BUILD = REPO / "build" / "pr-check"


def write_prefix(pr: PR, prefix: list[Path], dest: Path, patch_dir: Path = patches.PATCH_DIR) -> None:
    """A patch folder in ``dest`` holding the series' ``prefix`` up to ``pr`` (one PR group, as ``apply`` reads it)."""
    names = [patches.name(p, patch_dir) for p in prefix]
    for p, n in zip(prefix, names, strict=True):
        (dest / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest / n)
    (dest / patches.SERIES_FILE).write_text(f"# PR {pr.name}: the series up to and with {pr.name}\n"
                                            + "".join(f"{n}\n" for n in names))


def check(pr: PR, prefix: list[Path], full: bool) -> bool:
    with tempfile.TemporaryDirectory(dir=upstream.cache_root()) as tmp:
        subset = Path(tmp) / "series"
        subset.mkdir()
        write_prefix(pr, prefix, subset)
        # apply into a fresh copy, then move only the files that differ into PR_TREE (unchanged files keep their
        # times, so ninja does not rebuild them)
        fresh = patches.apply(Path(tmp) / "llama.cpp", subset)
        tree = sync_tree(fresh, PR_TREE)
        exclude = ctest_exclusions()
        if not full:
            exclude = exclude.replace(")$", "|" + "|".join(LONG_TESTS) + ")$")
        build = [
            ["cmake", "--preset", "host", "-B", str(PR_BUILD), f"-DLLAMA_CPP_DIR={tree}", "-DS3D8_BUILD_TESTS=OFF",
             "-DS3D8_UPSTREAM_TESTS=ON", f"-DGGML_VULKAN={'ON' if pr.vulkan else 'OFF'}"],
            # upstream's tools and tests only: this project's own tools (llama-mllama-dump) need the whole series
            ["cmake", "--build", str(PR_BUILD), "--target", *UPSTREAM_TOOLS, "upstream-tests"],
        ]
        test = ["ctest", "--test-dir", str(PR_BUILD), "-L", "^main$", "-E", exclude, "-j", "2", "--output-on-failure",
                "--no-tests=error"]
        ok = all(run(cmd, cwd=REPO) for cmd in build)
        clear_generated_models(PR_BUILD)
        ok = ok and run(test, cwd=REPO)
        ok = ok and all(run(list(cmd), cwd=PR_BUILD / "bin") for cmd in pr.checks)
    print(f"check-prs: {pr.name} ({len(prefix)} patches): {'OK' if ok else 'FAILED'}", flush=True)
    return ok


def clear_generated_models(build: Path) -> None:
    """Empty the folder that upstream's test-generate-models writes a model of each architecture into (and the
    state tests read every file of): a model left there by a longer prefix has an architecture this prefix may
    not know (mllama before the mllama PR), and the state tests would fail on it."""
    for f in (build / "llama.cpp" / "tests" / "test-models").glob("*.gguf"):
        f.unlink()


def sync_tree(src: Path, dest: Path) -> Path:
    """Make ``dest`` a copy of ``src`` (git metadata excluded), rewriting only the files whose bytes differ.

    A rewritten file gets the current time, not ``src``'s: a shorter prefix after a longer one puts back the pin's
    own files, whose times (the sdist's) are older than the objects the longer prefix built from its versions, and
    ninja would keep those objects."""
    dest.mkdir(parents=True, exist_ok=True)
    want = {p.relative_to(src) for p in src.rglob("*") if ".git" not in p.relative_to(src).parts and not p.is_dir()}
    have = {p.relative_to(dest) for p in dest.rglob("*") if not p.is_dir()}
    for rel in have - want:
        (dest / rel).unlink()
    for rel in want:
        a, b = src / rel, dest / rel
        if b.is_file() and not b.is_symlink() and not a.is_symlink() and a.read_bytes() == b.read_bytes():
            continue
        b.parent.mkdir(parents=True, exist_ok=True)
        if b.exists() or b.is_symlink():
            b.unlink()
        shutil.copy(a, b, follow_symlinks=False)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="PR", help="check one PR's prefix (a name of series' `# PR <name>:` headers)")
    ap.add_argument("--full", action="store_true", help=f"also run {', '.join(LONG_TESTS)}")
    ap.add_argument("--list", action="store_true", help="print the PRs and their patches, build nothing")
    args = ap.parse_args(argv)
    try:
        upstream.fetch()
        plan = prefixes()
        if args.only and args.only not in [pr.name for pr, _ in plan]:
            raise patches.PatchError(f"no PR {args.only!r} in {patches.SERIES_FILE}: "
                                     f"{', '.join(pr.name for pr, _ in plan)}")
    except (patches.PatchError, upstream.UpstreamError) as e:
        print(f"check-prs: error: {e}", file=sys.stderr)
        return 1
    start = 0
    results = []
    for pr, prefix in plan:
        if args.list:
            print(f"{pr.name}: {pr.title}")
            for p in prefix[start:]:
                print(f"    {patches.name(p)}")
        elif args.only in (None, pr.name):
            try:
                results.append(check(pr, prefix, args.full))
            except patches.PatchError as e:
                print(f"check-prs: {pr.name}: {e}", file=sys.stderr)
                results.append(False)
        start = len(prefix)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
