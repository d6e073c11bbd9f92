#!/usr/bin/env python3
"""Obtain the pinned upstream llama.cpp tree, offline-first, and cache it.

The patch series in ``ggml-patches/`` applies to exactly one upstream commit. This script produces that
tree from one of three sources and caches it under ``.cache/upstream/`` (ignored by git):

* ``sdist`` (default): the ``llama-cpp-python==0.3.36`` source distribution from PyPI, which vendors
  llama.cpp at the pinned commit together with its git metadata. The download is checked against a
  recorded sha256 and the vendored tree's ``HEAD`` against the pinned commit.
* ``git``: a clone of upstream (for users with network), checked out at the pinned commit.
* ``checkout``: an existing local checkout; its ``HEAD`` must be the pinned commit (or use ``--ref``).

Whatever the source, the cached tree is ``git archive`` of the commit, so it is byte-identical in all
three cases and never contains build outputs or local edits. The cache is never modified afterwards:
``ci/patches.py apply`` extracts a fresh copy from the cached tarball every time.

A second run downloads nothing. Only the standard library is used, so this runs before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PINNED_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST_FILENAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_VENDOR_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp"
UPSTREAM_GIT_URL = "https://github.com/ggml-org/llama.cpp"


class UpstreamError(RuntimeError):
    """A user-facing failure: printed as one line, exit status 1."""


def cache_root() -> Path:
    return Path(os.environ.get("S3D8_CACHE", REPO_ROOT / ".cache"))


def tarball_path(commit: str = PINNED_COMMIT) -> Path:
    """The cached ``git archive`` of the upstream commit (the source of every fresh copy)."""
    return cache_root() / "upstream" / f"llama.cpp-{commit}.tar"


def tree_path(commit: str = PINNED_COMMIT) -> Path:
    """A read-only extracted copy of the pristine tree, for reading upstream code."""
    return cache_root() / "upstream" / f"llama.cpp-{commit[:12]}"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def _git(repo: Path, *args: str, capture: bool = True) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, text=True,
                         stdout=subprocess.PIPE if capture else None)
    return (out.stdout or "").strip()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist() -> Path:
    """Download the sdist with pip (the only network client this project relies on) and verify it."""
    dest = cache_root() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST_FILENAME
    if path.exists() and sha256_file(path) == SDIST_SHA256:
        return path
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        print(f"upstream: downloading {SDIST_REQUIREMENT} sdist (~77 MB) with pip", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              SDIST_REQUIREMENT, "-d", tmp])
        got = Path(tmp) / SDIST_FILENAME
        if not got.exists():
            raise UpstreamError(f"pip did not produce {SDIST_FILENAME}")
        digest = sha256_file(got)
        if digest != SDIST_SHA256:
            raise UpstreamError(f"{SDIST_FILENAME}: sha256 {digest} != recorded {SDIST_SHA256}; refusing to use it")
        os.replace(got, path)
    return path


def _archive_commit(git_dir_tree: Path, commit: str, out_tar: Path) -> None:
    """Write ``git archive`` of ``commit`` from a checkout to ``out_tar`` atomically."""
    head = _git(git_dir_tree, "rev-parse", "HEAD")
    if head != commit:
        # try the requested commit directly (a clone or checkout that has it but is elsewhere)
        try:
            _git(git_dir_tree, "cat-file", "-e", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            raise UpstreamError(f"{git_dir_tree}: HEAD is {head}, and commit {commit} is not available") from None
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_tar.with_suffix(".tar.tmp")
    with open(tmp, "wb") as f:
        subprocess.run(["git", "-C", str(git_dir_tree), "archive", "--format=tar", commit], check=True, stdout=f)
    os.replace(tmp, out_tar)


def from_sdist(commit: str) -> None:
    if commit != PINNED_COMMIT:
        raise UpstreamError(f"the sdist only carries {PINNED_COMMIT}; use --source git/checkout for {commit}")
    sdist = download_sdist()
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        print("upstream: extracting vendored llama.cpp from the sdist", file=sys.stderr)
        with tarfile.open(sdist) as tf:
            top = SDIST_VENDOR_DIR.split("/")[0]
            members = [m for m in tf.getmembers()
                       if m.name.startswith(SDIST_VENDOR_DIR + "/") or m.name.startswith(f"{top}/.git/")]
            tf.extractall(tmp, members=members, filter="tar")
        vendor = Path(tmp) / SDIST_VENDOR_DIR
        head = _git(vendor, "rev-parse", "HEAD")
        if head != commit:
            raise UpstreamError(f"the sdist's vendored llama.cpp is at {head}, expected {commit}")
        _archive_commit(vendor, commit, tarball_path(commit))


def resolve_git(ref: str, url: str) -> str:
    """Fetch ``ref`` (commit, branch or tag) from ``url``, cache its tree, return the commit id."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        clone = Path(tmp) / "llama.cpp"
        print(f"upstream: fetching {ref} from {url}", file=sys.stderr)
        _run(["git", "init", "-q", str(clone)])
        _run(["git", "-C", str(clone), "fetch", "-q", "--depth", "1", url, ref])
        commit = _git(clone, "rev-parse", "FETCH_HEAD")
        _run(["git", "-C", str(clone), "checkout", "-q", "--detach", commit])
        if not tarball_path(commit).exists():
            _archive_commit(clone, commit, tarball_path(commit))
    return commit


def resolve_checkout(checkout: Path) -> str:
    """Cache the tree at ``checkout``'s HEAD; return the commit id."""
    commit = _git(checkout, "rev-parse", "HEAD")
    if not tarball_path(commit).exists():
        from_checkout(commit, checkout)
    return commit


def from_git(commit: str, url: str) -> None:
    got = resolve_git(commit, url)
    if got != commit:
        raise UpstreamError(f"{url} gave {got} for {commit}")


def from_checkout(commit: str, checkout: Path) -> None:
    if not (checkout / "ggml" / "include" / "ggml.h").exists():
        raise UpstreamError(f"{checkout} does not look like a llama.cpp checkout")
    _archive_commit(checkout, commit, tarball_path(commit))


def extract_tree(commit: str, dest: Path) -> None:
    """Extract the cached tarball of ``commit`` into ``dest`` (which must not exist)."""
    tar = tarball_path(commit)
    if not tar.exists():
        raise UpstreamError(f"{tar} missing: run `python3 ci/upstream.py fetch` first")
    if dest.exists():
        raise UpstreamError(f"{dest} already exists")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tar) as tf:
        tf.extractall(tmp, filter="tar")
    os.replace(tmp, dest)


def fetch(source: str = "sdist", commit: str = PINNED_COMMIT, url: str = UPSTREAM_GIT_URL,
          checkout: Path | None = None) -> Path:
    """Ensure the cached tarball and the read-only reference tree exist; return the tree's path."""
    cache_root().mkdir(parents=True, exist_ok=True)
    if not tarball_path(commit).exists():
        if source == "sdist":
            from_sdist(commit)
        elif source == "git":
            from_git(commit, url)
        elif source == "checkout":
            if checkout is None:
                raise UpstreamError("--source checkout needs --checkout PATH")
            from_checkout(commit, checkout)
        else:
            raise UpstreamError(f"unknown source {source!r}")
    tree = tree_path(commit)
    if not tree.exists():
        extract_tree(commit, tree)
        # the reference tree is for reading; patches are applied to fresh copies elsewhere
        for p in tree.rglob("*"):
            if p.is_file() and not p.is_symlink():
                p.chmod(p.stat().st_mode & 0o555)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="obtain and cache the upstream tree; prints the reference tree's path")
    f.add_argument("--source", choices=["sdist", "git", "checkout"], default="sdist",
                   help="where to get the tree from (default: the PyPI sdist, works offline-with-PyPI)")
    f.add_argument("--commit", default=PINNED_COMMIT, help="upstream commit (default: the pinned one)")
    f.add_argument("--url", default=UPSTREAM_GIT_URL, help="git URL for --source git")
    f.add_argument("--checkout", type=Path, help="existing llama.cpp checkout for --source checkout")
    sub.add_parser("path", help="print the cached tarball path of the pinned commit")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch(args.source, args.commit, args.url, args.checkout))
        else:
            print(tarball_path())
    except (UpstreamError, subprocess.CalledProcessError) as e:
        print(f"upstream: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
