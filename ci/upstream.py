#!/usr/bin/env python3
"""Obtain an upstream llama.cpp tree the patch series targets, offline-first, and cache it.

The patch series in ``ggml-patches/`` applies to exactly one upstream tree, the *pin*. Upstream trees are
named by their build number (``b11549``) and listed in ``TREES``, each with the PyPI source distribution that
vendors it unpatched and the git tree hash of its files, so that every source gives the same bytes:

* ``sdist`` (default): the tree's source distribution from PyPI (the only network the project relies on),
  sha256-checked; the vendored tree is checked against the recorded commit (an sdist with git metadata) or
  against the recorded git tree hash of all its files (an sdist without it).
* ``git``: a clone of upstream at a commit, branch or tag (for users with network).
* ``checkout``: an existing local checkout (its ``HEAD``).

Whatever the source, the cached tree is a tarball of the tree (``git archive``), so it never contains build
outputs or local edits; a tree is named in the cache by its build name or, for a git source, by its commit.
The cache is never modified afterwards: ``ci/patches.py apply`` extracts a fresh copy every time.

    python3 ci/upstream.py fetch                   # the pin (prints the read-only reference tree's path)
    python3 ci/upstream.py fetch --tree b11312     # the previous pin, e.g. for an A/B against the old tree
    python3 ci/upstream.py list                    # the known trees: pin, previous pin, newer ones to check

A second run downloads nothing. Only the standard library is used, so this runs before any venv exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_GIT_URL = "https://github.com/ggml-org/llama.cpp"


@dataclass(frozen=True)
class Sdist:
    """A PyPI source distribution that vendors an unpatched upstream tree."""

    requirement: str  # what pip downloads
    filename: str
    sha256: str
    vendor_dir: str  # the tree's folder inside the archive
    size: str  # for the progress line


@dataclass(frozen=True)
class UpstreamTree:
    """One upstream llama.cpp tree the project can fetch."""

    name: str  # upstream's build tag, also the tree's name in the cache
    sdist: Sdist
    #: ``git write-tree`` of every file of the vendored tree (``git add -A -f`` in a fresh repository); checks an
    #: sdist without git metadata
    tree_hash: str
    #: the upstream commit, where the sdist carries git metadata (then checked against the vendored ``HEAD``)
    commit: str | None = None
    role: str = ""


TREES: dict[str, UpstreamTree] = {t.name: t for t in (
    UpstreamTree(
        name="b11312", role="previous pin",
        sdist=Sdist("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
                    "llama_cpp_python-0.3.36/vendor/llama.cpp", "~77 MB"),
        tree_hash="", commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f"),
    UpstreamTree(
        name="b11549", role="pin",
        sdist=Sdist("xllamacpp==2026.10.11549", "xllamacpp-2026.10.11549.tar.gz",
                    "c17ee1163006f70726abb9f72137830818f3d8cb60bfc34cb232d08428eaa22b",
                    "xllamacpp-2026.10.11549/thirdparty/llama.cpp", "~38 MB"),
        tree_hash="ee320e359dbb0816d6bd0d873585a3ca932e9313"),
)}
#: the tree the series applies to
PIN = "b11549"
#: every tree the series is checked against by ``ci/check_upstream.py`` (and so by CI): the pin and any
#: newer tree listed above; older trees stay fetchable for comparisons but the series no longer targets them
CHECKED = ("b11549",)


#: other llama.cpp trees whose ggml type ids the series must not take unknowingly (ci/check_upstream.py): files
#: made by one may be opened by the other. Only their ggml.h is read, straight from the sha256-checked sdist.
NEIGHBOURS: dict[str, Sdist] = {
    "ik_llama.cpp": Sdist("ik-llama-cpp-python==0.1.5", "ik_llama_cpp_python-0.1.5.tar.gz",
                          "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad",
                          "ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp", "~42 MB"),
}


class UpstreamError(RuntimeError):
    """A user-facing failure: printed as one line, exit status 1."""


def cache_root() -> Path:
    return Path(os.environ.get("S3D8_CACHE", REPO_ROOT / ".cache"))


def tarball_path(ref: str = PIN) -> Path:
    """The cached tarball of a tree (a ``TREES`` name or a commit): the source of every fresh copy."""
    return cache_root() / "upstream" / f"llama.cpp-{ref}.tar"


def tree_path(ref: str = PIN) -> Path:
    """A read-only extracted copy of the pristine tree, for reading upstream code."""
    return cache_root() / "upstream" / f"llama.cpp-{ref[:12]}"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def _git(repo: Path, *args: str, capture: bool = True) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, text=True,
                         stdout=subprocess.PIPE if capture else None)
    return (out.stdout or "").strip()


def _load_fsio() -> types.ModuleType:
    """``gguf_s3d8/fsio.py`` (standard library only), loaded by its path: this script runs before the virtual
    environment and numpy exist, and the ``gguf_s3d8`` package imports numpy."""
    spec = importlib.util.spec_from_file_location("_s3d8_fsio", REPO_ROOT / "gguf_s3d8" / "fsio.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FSIO = _load_fsio()
#: the tree's one file digest and atomic writer (gguf_s3d8.fsio)
sha256_file = _FSIO.sha256_file
atomic_file = _FSIO.atomic_file
atomic_path = _FSIO.atomic_path


def known(name: str) -> UpstreamTree:
    try:
        return TREES[name]
    except KeyError:
        raise UpstreamError(f"unknown upstream tree {name!r}; known: {', '.join(TREES)}") from None


def _index_url() -> str:
    """The package index pip uses here (``PIP_INDEX_URL`` or ``pip config``'s ``index-url``), else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, timeout=60)
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    return (url or "https://pypi.org/simple").rstrip("/")


def _download_from_index(sdist: Sdist, dest: Path) -> Path:
    """The sdist file itself from the index's JSON simple API (PEP 691). ``pip download`` of an sdist also builds
    its metadata, i.e. installs the package's build requirements first: minutes, for a file of a few seconds."""
    project = sdist.requirement.split("==")[0]
    req = urllib.request.Request(f"{_index_url()}/{project}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    [entry] = [f for f in files if f["filename"] == sdist.filename]
    url = urllib.parse.urljoin(req.full_url, entry["url"])
    got = dest / sdist.filename
    with urllib.request.urlopen(url, timeout=600) as r, open(got, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)
    return got


def download_sdist(sdist: Sdist) -> Path:
    """Download the sdist from the package index (directly, else with pip) and verify its sha256."""
    dest = cache_root() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / sdist.filename
    if path.exists() and sha256_file(path) == sdist.sha256:
        return path
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        print(f"upstream: downloading the {sdist.requirement} sdist ({sdist.size})", file=sys.stderr)
        try:
            got = _download_from_index(sdist, Path(tmp))
        except (OSError, urllib.error.URLError, KeyError, ValueError) as e:
            # an index without the JSON API, a proxy only pip knows: pip, which also builds the metadata
            print(f"upstream: direct download failed ({e}); asking pip", file=sys.stderr)
            _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                  sdist.requirement, "-d", tmp])
            got = Path(tmp) / sdist.filename
        if not got.exists():
            raise UpstreamError(f"no {sdist.filename} was downloaded")
        digest = sha256_file(got)
        if digest != sdist.sha256:
            raise UpstreamError(f"{sdist.filename}: sha256 {digest} != recorded {sdist.sha256}; refusing to use it")
        with atomic_path(path) as final:
            os.replace(got, final)
    return path


def neighbour_file(name: str, path: str) -> str:
    """The text of ``path`` in a neighbour tree (``NEIGHBOURS``), read from its sdist without extracting the rest."""
    sdist = NEIGHBOURS[name]
    member = f"{sdist.vendor_dir}/{path}"
    with tarfile.open(download_sdist(sdist)) as tf:
        try:
            f = tf.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise UpstreamError(f"{sdist.filename} has no {member}")
        return f.read().decode()


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
    with atomic_file(out_tar) as f:
        subprocess.run(["git", "-C", str(git_dir_tree), "archive", "--format=tar", commit], check=True, stdout=f)


def _check_identity(tree: UpstreamTree, repo: Path, commit: str, what: str) -> None:
    """``commit`` in ``repo`` must be ``tree``: its recorded commit, or else its recorded tree hash."""
    if tree.commit:
        if commit != tree.commit:
            raise UpstreamError(f"{what} is at {commit}, expected {tree.name} = {tree.commit}")
        return
    got = _git(repo, "rev-parse", f"{commit}^{{tree}}")
    if got != tree.tree_hash:
        raise UpstreamError(f"{what}: git tree {got} is not {tree.name}'s recorded {tree.tree_hash}")


#: a fixed identity and date for the commits made of an upstream tree (here and by ci/patches.py's base commits):
#: their hash is a pure function of the tree and the message
FIXED_IDENTITY = {"GIT_AUTHOR_NAME": "llama.cpp upstream", "GIT_AUTHOR_EMAIL": "upstream@llama.cpp.invalid",
                  "GIT_COMMITTER_NAME": "llama.cpp upstream", "GIT_COMMITTER_EMAIL": "upstream@llama.cpp.invalid",
                  "GIT_AUTHOR_DATE": "2026-10-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-10-01T00:00:00Z"}


def commit_all(folder: Path, message: str) -> str:
    """Make ``folder`` (no git metadata) a repository, branch ``main``, with every file in one commit of
    ``FIXED_IDENTITY``; return the commit."""
    env = {**os.environ, **FIXED_IDENTITY}
    for args in (["init", "-q", "-b", "main"], ["-c", "core.autocrlf=false", "add", "-A", "-f"],
                 ["commit", "-q", "--no-verify", "--no-gpg-sign", "-m", message]):
        subprocess.run(["git", "-C", str(folder), *args], check=True, env=env, stdout=subprocess.DEVNULL)
    return _git(folder, "rev-parse", "HEAD")


def from_sdist(tree: UpstreamTree) -> None:
    sdist = download_sdist(tree.sdist)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        print(f"upstream: extracting the vendored llama.cpp {tree.name} from the sdist", file=sys.stderr)
        top = tree.sdist.vendor_dir.split("/")[0]
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers()
                       if m.name.startswith(tree.sdist.vendor_dir + "/") or m.name.startswith(f"{top}/.git/")]
            tf.extractall(tmp, members=members, filter="tar")
        vendor = Path(tmp) / tree.sdist.vendor_dir
        if tree.commit:  # the sdist carries the repository: its HEAD is the tree
            commit = _git(vendor, "rev-parse", "HEAD")
        else:
            commit = commit_all(vendor, f"llama.cpp {tree.name} from {tree.sdist.filename}")
        _check_identity(tree, vendor, commit, f"the {tree.sdist.filename} vendored llama.cpp")
        _archive_commit(vendor, commit, tarball_path(tree.name))


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
        _require_llama_cpp(checkout)
        _archive_commit(checkout, commit, tarball_path(commit))
    return commit


def _require_llama_cpp(checkout: Path) -> None:
    if not (checkout / "ggml" / "include" / "ggml.h").exists():
        raise UpstreamError(f"{checkout} does not look like a llama.cpp checkout")


def from_git(tree: UpstreamTree, url: str) -> None:
    """The named tree from upstream's repository (its build tag), checked against the recorded identity."""
    commit = resolve_git(tree.commit or tree.name, url)
    if tree.commit:
        _check_identity(tree, cache_root(), commit, f"{url} {tree.name}")
    else:  # the tree hash of the fetched files (resolve_git keeps no clone: from its archive)
        with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
            repo = Path(tmp) / "t"
            extract_tree(commit, repo)
            _check_identity(tree, repo, commit_all(repo, tree.name), f"{url} {tree.name}")
    shutil.copyfile(tarball_path(commit), tarball_path(tree.name))


def from_checkout(tree: UpstreamTree, checkout: Path) -> None:
    _require_llama_cpp(checkout)
    commit = _git(checkout, "rev-parse", "HEAD")
    _check_identity(tree, checkout, commit, str(checkout))
    _archive_commit(checkout, commit, tarball_path(tree.name))


def extract_tree(ref: str, dest: Path) -> None:
    """Extract the cached tarball of ``ref`` (a tree name or a commit) into ``dest`` (which must not exist)."""
    tar = tarball_path(ref)
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


def fetch(name: str = PIN, source: str = "sdist", url: str = UPSTREAM_GIT_URL,
          checkout: Path | None = None) -> Path:
    """Ensure the named tree's cached tarball and read-only reference tree exist; return the tree's path."""
    tree = known(name)
    cache_root().mkdir(parents=True, exist_ok=True)
    if not tarball_path(name).exists():
        if source == "sdist":
            from_sdist(tree)
        elif source == "git":
            from_git(tree, url)
        elif source == "checkout":
            if checkout is None:
                raise UpstreamError("--source checkout needs --checkout PATH")
            from_checkout(tree, checkout)
        else:
            raise UpstreamError(f"unknown source {source!r}")
    ref_tree = tree_path(name)
    if not ref_tree.exists():
        extract_tree(name, ref_tree)
        # the reference tree is for reading; patches are applied to fresh copies elsewhere
        for p in ref_tree.rglob("*"):
            if p.is_file() and not p.is_symlink():
                p.chmod(p.stat().st_mode & 0o555)
    return ref_tree


def cli_failed(prog: str, e: BaseException) -> int:
    """Print ``PROG: error: E`` on stderr and give the exit status of a failed command (1): the CI scripts' ending."""
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="obtain and cache an upstream tree; prints the reference tree's path")
    f.add_argument("--tree", default=PIN, choices=list(TREES), help=f"which tree (default: the pin, {PIN})")
    f.add_argument("--source", choices=["sdist", "git", "checkout"], default="sdist",
                   help="where to get the tree from (default: its PyPI sdist, works offline-with-PyPI)")
    f.add_argument("--url", default=UPSTREAM_GIT_URL, help="git URL for --source git")
    f.add_argument("--checkout", type=Path, help="existing llama.cpp checkout for --source checkout")
    p = sub.add_parser("path", help="print the cached tarball path of a tree")
    p.add_argument("--tree", default=PIN, choices=list(TREES))
    sub.add_parser("list", help="the known trees, their roles and sources")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch(args.tree, args.source, args.url, args.checkout))
        elif args.cmd == "path":
            print(tarball_path(args.tree))
        else:
            for t in TREES.values():
                role = t.role + (", checked by CI" if t.name in CHECKED and t.name != PIN else "")
                print(f"{t.name:8} {role or '-':28} {t.sdist.requirement:28} {t.commit or 'tree ' + t.tree_hash}")
    except (UpstreamError, subprocess.CalledProcessError) as e:
        return cli_failed("upstream", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
