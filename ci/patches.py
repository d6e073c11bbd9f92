#!/usr/bin/env python3
"""Apply and export the ``ggml-patches/`` series against the pinned upstream llama.cpp.

Workflow (patches are edited as real code, then regenerated):

    python3 ci/patches.py apply            # fresh copy of the pinned tree in work/llama.cpp, series applied as commits
    cd work/llama.cpp && $EDITOR ... && git commit --fixup/--amend or git rebase -i upstream-base
    python3 ci/patches.py export           # rewrite ggml-patches/ from the commits upstream-base..HEAD
    python3 ci/patches.py check            # apply -> export in a temp dir must reproduce ggml-patches/ byte for byte
    python3 ci/patches.py rebase --onto b11549   # move work/llama.cpp onto another upstream tree (docs/upstreaming.md)

The series is ``ggml-patches/series`` (patch file names, one a line, in application order, as quilt keeps them)
grouped by pull request: each group starts with a header line ``# PR <name>: <title>``, may go on with comment
lines that describe it, then lists its patches, ``<name>/NN-<words of the subject>.patch`` (numbered within the
PR). ``export`` writes the files and ``series`` and keeps the groups and their comment lines: a patch whose subject
gives the name of one in ``series`` stays in that PR, a new patch joins the PR of the patch before it (the first
PR when it comes first), and a series whose PRs would no longer follow each other in order is refused. To move a
patch to another PR, or to start a new PR, move its line (under a new header) in ``series`` and export again.
``apply`` reads ``series`` and refuses a folder whose ``.patch`` files and ``series`` disagree, or a patch listed
before any header.

``apply`` never touches the cache: it extracts a fresh copy of the cached upstream tarball, commits it as a
deterministic base commit tagged ``upstream-base`` and runs one ``git am -3`` over the whole series. A patch
that does not apply stops there with the patch's name and git's reason, and the tree is left in ``git am``'s
state with the three-way conflict in the files: resolve it, ``git add`` and ``git am --continue`` (which applies
the rest of the series), then ``export``. The series may be empty.

``export`` uses ``git format-patch`` with settings that make the output depend only on the commits'
content, author and message (zeroed ``From`` hashes, no signature, fixed abbreviation), so that
apply → export is byte-identical.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream  # noqa: E402

REPO_ROOT = upstream.REPO_ROOT
PATCH_DIR = REPO_ROOT / "ggml-patches"
DEFAULT_WORKTREE = REPO_ROOT / "work" / "llama.cpp"
BASE_TAG = "upstream-base"
SERIES_FILE = "series"

# Options that make format-patch output independent of commit hashes, git config and terminal.
_FORMAT_PATCH_OPTS = ["--zero-commit", "--no-numbered", "--no-signature", "--no-cover-letter", "--no-binary",
                      "--abbrev=12", "--stat=80", "--no-color", "--no-renames", "--encode-email-headers"]
_GIT_CONFIG = ["-c", "core.abbrev=12", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
               "-c", "format.signature=", "-c", "core.autocrlf=false", "-c", "user.useConfigOnly=false"]


class PatchError(RuntimeError):
    """A user-facing failure, printed as a clear message."""


def git(repo: Path, *args: str, env: dict | None = None, check: bool = True,
        capture: bool = True) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.setdefault("GIT_COMMITTER_NAME", "s3d8 developer")
    full_env.setdefault("GIT_COMMITTER_EMAIL", "dev@s3d8.invalid")
    if env:
        full_env.update(env)
    return subprocess.run(["git", *_GIT_CONFIG, "-C", str(repo), *args], check=check, text=True, env=full_env,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


#: a group's header line in ``series``; the name is also the group's folder
_PR_HEADER = re.compile(r"^# PR ([a-z0-9][a-z0-9-]*): (\S.*)$")
#: the longest file name stem made of a subject (``patch_stem``), so that ``<pr>/NN-<stem>.patch`` stays near 70
STEM_LIMIT = 52


@dataclass
class Group:
    """One pull request of the series: its header line and the comment lines under it (kept verbatim by ``export``)
    and its patches (paths relative to the patch folder, in application order)."""
    name: str
    title: str
    text: list[str]
    patches: list[str] = field(default_factory=list)


@dataclass
class Layout:
    """``series`` parsed: the lines before the first PR header (verbatim) and the PRs in order."""
    preamble: list[str]
    groups: list[Group]

    def render(self) -> str:
        """The text of ``series``: the preamble, then each PR's header, comments and patches, a blank line between
        PRs."""
        lines = list(self.preamble)
        for i, g in enumerate(self.groups):
            lines += ([""] if i else []) + g.text + g.patches
        return "".join(f"{ln}\n" for ln in lines)


def read_layout(patch_dir: Path = PATCH_DIR) -> Layout:
    """Parse ``patch_dir/series`` into its PRs (an absent file is the empty series). Raises PatchError for a patch
    listed before any ``# PR <name>: <title>`` header, a malformed or repeated header, or a comment line between a
    PR's patches (``export`` could not keep it in place)."""
    index = patch_dir / SERIES_FILE
    layout = Layout([], [])
    if not index.is_file():
        return layout
    for n, raw in enumerate(index.read_text().splitlines(), 1):
        line = raw.rstrip()
        where = f"{index}:{n}"
        m = _PR_HEADER.match(line)
        if m:
            if any(g.name == m[1] for g in layout.groups):
                raise PatchError(f"{where}: a second header for PR {m[1]}")
            layout.groups.append(Group(m[1], m[2], [line]))
        elif line.startswith("# PR ") or line == "# PR":
            raise PatchError(f"{where}: a PR header is `# PR <name>: <title>` with a name of a-z, 0-9 and -: {line!r}")
        elif not layout.groups:
            if line and not line.startswith("#"):
                raise PatchError(f"{where}: {line} belongs to no PR: every patch follows a `# PR <name>: <title>` "
                                 "header")
            layout.preamble.append(line)
        elif not line:
            continue
        elif line.startswith("#"):
            group = layout.groups[-1]
            if group.patches:
                raise PatchError(f"{where}: a comment between the patches of PR {group.name}; a PR's comment lines "
                                 "go under its header, before its patches")
            group.text.append(line)
        else:
            layout.groups[-1].patches.append(line)
    return layout


def groups(patch_dir: Path = PATCH_DIR) -> list[tuple[Group, list[Path]]]:
    """Each PR of the series with its patch files, in order (checked as ``series`` checks them)."""
    series(patch_dir)
    return [(g, [patch_dir / n for n in g.patches]) for g in read_layout(patch_dir).groups]


def series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """The patches in application order, as ``patch_dir/series`` lists them (a folder without patches and without
    that file is the empty series). Raises PatchError when the list and the folder's ``.patch`` files differ, or as
    ``read_layout`` does."""
    present = {p.relative_to(patch_dir).as_posix() for p in patch_dir.rglob("*.patch")}
    index = patch_dir / SERIES_FILE
    if not index.is_file():
        if present:
            raise PatchError(f"{patch_dir} has .patch files but no {SERIES_FILE} file giving their order "
                             "(`ci/patches.py export` writes both)")
        return []
    names = [n for g in read_layout(patch_dir).groups for n in g.patches]
    missing = [n for n in names if n not in present]
    unlisted = sorted(present - set(names))
    repeated = sorted({n for n in names if names.count(n) > 1})
    if missing or unlisted or repeated:
        raise PatchError(f"{index} does not match the folder's patches: "
                         + "; ".join(f"{what}: {', '.join(ns)}" for what, ns in
                                     (("listed but missing", missing), ("not listed", unlisted),
                                      ("listed twice", repeated)) if ns))
    return [patch_dir / n for n in names]


def name(patch: Path, patch_dir: Path = PATCH_DIR) -> str:
    """A patch's name in ``series`` (``<pr>/NN-<stem>.patch``)."""
    return patch.relative_to(patch_dir).as_posix()


_ARTICLES = {"a", "an", "the"}
#: words a name cut short must not end with
_DANGLING = {"and", "or", "for", "with", "without", "of", "to", "in", "at", "on", "by", "from", "before", "after",
             "than", "over", "is", "are", "its", "their", "that", "whose", "not"}


def patch_stem(subject: str, limit: int = STEM_LIMIT) -> str:
    """The file name stem of a commit subject: its words (the component before `` : `` first; letters, digits and
    ``- _ . +`` kept) joined by ``-``, without articles and possessive 's, cut at a word boundary to ``limit``
    characters and then without a dangling conjunction or preposition at its end (a pure function of the subject,
    so that ``export`` finds a patch's PR by its name)."""
    component, sep, text = subject.partition(" : ")
    if not sep:
        component, text = "", subject
    text = re.sub(r"'s\b", "", text)
    words = [w.strip("-._+") for w in re.split(r"[^-A-Za-z0-9_.+]+", component)]
    words += [w.strip("-._+") for w in re.split(r"[^-A-Za-z0-9_.+]+", text) if w.lower() not in _ARTICLES]
    words = [w for w in words if w]
    kept: list[str] = []
    for w in words:
        if kept and len("-".join([*kept, w])) > limit:
            while len(kept) > 1 and kept[-1].lower() in _DANGLING:
                kept.pop()
            break
        kept.append(w)
    return "-".join(kept)[:limit] or "patch"


def _stem_of(name: str) -> str:
    """The stem of a series entry: its file name without ``NN-`` and ``.patch``."""
    base = name.rsplit("/", 1)[-1].removesuffix(".patch")
    return re.sub(r"^\d+-", "", base)


def assign(layout: Layout, subjects: list[str]) -> list[str]:
    """The series names of the commits with ``subjects`` (in order): each in its PR of ``layout`` (the PR whose
    entry has its stem; otherwise the PR of the commit before it, the first PR for the first), numbered within its
    PR. Rewrites the PRs' patch lists in ``layout``; a PR left without patches keeps its header. Raises PatchError
    when ``layout`` has no PR, or when the commits' PRs do not follow the order of ``layout``."""
    if subjects and not layout.groups:
        raise PatchError(f"{SERIES_FILE} has no `# PR <name>: <title>` header, so the PR of each patch cannot be "
                         f"determined: write the headers into {SERIES_FILE} (docs/upstreaming.md, \"The PRs\")")
    known: dict[str, list[int]] = {}
    for gi, g in enumerate(layout.groups):
        for n in g.patches:
            known.setdefault(_stem_of(n), []).append(gi)
    owner: list[int] = []
    for subject in subjects:
        stem = patch_stem(subject)
        gi = known[stem].pop(0) if known.get(stem) else (owner[-1] if owner else 0)
        if owner and gi < owner[-1]:
            raise PatchError(f"patch {subject!r} of PR {layout.groups[gi].name} comes after a patch of PR "
                             f"{layout.groups[owner[-1]].name}, which {SERIES_FILE} puts after it: reorder the commits "
                             f"(`git rebase -i {BASE_TAG}`) or move the line in {SERIES_FILE}")
        owner.append(gi)
    for g in layout.groups:
        g.patches = []
    names = []
    for subject, gi in zip(subjects, owner, strict=True):
        g = layout.groups[gi]
        g.patches.append(f"{g.name}/{len(g.patches) + 1:02d}-{patch_stem(subject)}.patch")
        names.append(g.patches[-1])
    return names


def has_unexported_work(tree: Path) -> str | None:
    """Describe uncommitted changes in ``tree`` (which apply would destroy), or None."""
    if not (tree / ".git").exists():
        return None
    status = git(tree, "status", "--porcelain", "--untracked-files=normal").stdout.strip()
    return status or None


def series_digest(patch_dir: Path = PATCH_DIR, ref: str = upstream.PIN) -> str:
    """A digest of the upstream tree's name and the series' file names and bytes: what a working tree was made from
    (so that a new pin re-applies the series as a changed patch does)."""
    h = hashlib.sha256(ref.encode() + b"\0")
    for p in series(patch_dir):  # names in order, then bytes: also a reordering changes the digest
        h.update(name(p, patch_dir).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _stamp_path(tree: Path) -> Path:
    # kept beside the tree, not in it, so that it never shows up as an untracked file there
    return tree.with_name(tree.name + ".applied")


def make_base(tree: Path, ref: str = upstream.PIN) -> None:
    """A fresh git tree of the cached upstream tree ``ref`` (a tree name or a commit) with one deterministic commit
    tagged upstream-base."""
    upstream.extract_tree(ref, tree)
    upstream.commit_all(tree, f"upstream llama.cpp {ref}")
    git(tree, "tag", BASE_TAG)


def apply(tree: Path = DEFAULT_WORKTREE, patch_dir: Path = PATCH_DIR, force: bool = False,
          ref: str = upstream.PIN) -> Path:
    """Create ``tree`` as a fresh patched copy of the pinned upstream tree."""
    if tree.exists():
        dirty = has_unexported_work(tree)
        if dirty and not force:
            raise PatchError(f"{tree} has uncommitted changes; export or commit them, or pass --force to discard:\n"
                             + dirty)
        shutil.rmtree(tree)
    todo = series(patch_dir)
    make_base(tree, ref)
    if todo:
        # one `git am -3` over the whole series: a conflict is left in the tree (three-way merge markers) and
        # `git am --continue` goes on with the rest of the series
        r = git(tree, "am", "-3", "--keep-cr", "--committer-date-is-author-date", "--no-gpg-sign",
                *map(str, todo), check=False)
        if r.returncode != 0:
            state = tree / ".git" / "rebase-apply" / "next"
            stopped = int(state.read_text()) if state.is_file() else 0
            failed = name(todo[stopped - 1], patch_dir) if 0 < stopped <= len(todo) else "(unknown: git am ended early)"
            detail = "\n".join(ln for ln in (r.stdout + r.stderr).splitlines()
                                if ln.startswith(("error:", "warning:", "fatal:", "CONFLICT")))
            raise PatchError(f"patch {failed} does not apply cleanly to llama.cpp {ref[:12]}:\n{detail}\n"
                             f"the conflict is left in {tree} (in `git am`'s state): resolve it there, `git add` the "
                             f"files, `git am --continue` (the rest of the series follows; `git am --abort` gives up), "
                             f"then `python3 ci/patches.py export`")
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    _stamp_path(tree).write_text(f"{series_digest(patch_dir, ref)} {head}\n")
    return tree


def base_ref(tree: Path) -> str:
    """The upstream tree a patched tree was made from (named in its base commit by ``make_base``)."""
    subject = git(tree, "log", "-1", "--format=%s", BASE_TAG).stdout.strip()
    prefix = "upstream llama.cpp "
    if not subject.startswith(prefix):
        raise PatchError(f"{tree}: the {BASE_TAG} commit ({subject!r}) was not made by ci/patches.py")
    return subject[len(prefix):]


def sync(tree: Path = DEFAULT_WORKTREE, patch_dir: Path = PATCH_DIR) -> str:
    """Make ``tree`` match the series, without ever destroying a developer's work.

    Applies when the tree is missing, or when the series changed since the tree was made and the tree
    holds nothing new (no uncommitted changes, HEAD still the commit ``apply`` produced). Otherwise it
    keeps the tree and says so (the developer's edits are what they want built). Returns a one-line description of what happened.
    """
    if not tree.exists():
        apply(tree, patch_dir)
        return "applied"
    stamp = _stamp_path(tree)
    digest, _, head = stamp.read_text().partition(" ") if stamp.exists() else ("", "", "")
    dirty = has_unexported_work(tree)
    if digest == series_digest(patch_dir):
        return "up to date, with uncommitted local changes" if dirty else "up to date"
    current = git(tree, "rev-parse", "HEAD").stdout.strip() if (tree / ".git").exists() else ""
    if dirty or current != head.strip():
        # a developer is editing the series in this tree: build what they have, and say so
        return ("KEPT, it holds work that differs from ggml-patches/ "
                "(`ci/patches.py export` to save it, `ci/patches.py apply --force` to discard it)")
    apply(tree, patch_dir, force=True)
    return "re-applied (series changed)"


def export(tree: Path = DEFAULT_WORKTREE, patch_dir: Path = PATCH_DIR) -> list[Path]:
    """Rewrite ``patch_dir`` from the commits ``upstream-base..HEAD`` of ``tree``, in the PRs of its ``series``
    (``assign``)."""
    if not (tree / ".git").exists():
        raise PatchError(f"{tree} is not a patched working tree (run `ci/patches.py apply` first)")
    dirty = has_unexported_work(tree)
    if dirty:
        raise PatchError(f"{tree} has uncommitted changes; commit them first (they would not be exported):\n{dirty}")
    merges = git(tree, "rev-list", "--merges", f"{BASE_TAG}..HEAD").stdout.strip()
    if merges:
        raise PatchError("the series must be linear; found merge commits:\n" + merges)
    layout = read_layout(patch_dir)
    subjects = git(tree, "log", "--reverse", "--format=%s", f"{BASE_TAG}..HEAD").stdout.splitlines()
    names = assign(layout, subjects)
    patch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=patch_dir.parent) as tmp:
        git(tree, "format-patch", *_FORMAT_PATCH_OPTS, "-o", tmp, f"{BASE_TAG}..HEAD")
        new = sorted(Path(tmp).glob("*.patch"))  # NNNN-<subject>.patch: sorted is the series order
        if len(new) != len(names):
            raise PatchError(f"git format-patch wrote {len(new)} patches for {len(names)} commits")
        for old in patch_dir.rglob("*.patch"):
            old.unlink()
        for folder in patch_dir.iterdir():
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        out = []
        for p, n in zip(new, names, strict=True):
            dest = patch_dir / n
            dest.parent.mkdir(exist_ok=True)
            shutil.move(str(p), dest)
            out.append(dest)
        (patch_dir / SERIES_FILE).write_text(layout.render())
    # the tree now is exactly what the series describes
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    _stamp_path(tree).write_text(f"{series_digest(patch_dir, base_ref(tree))} {head}\n")
    return out


OLD_BASE_TAG = "upstream-base-before-rebase"


def rebase(tree: Path = DEFAULT_WORKTREE, onto: str = upstream.PIN) -> str:
    """Move the patched ``tree`` onto another upstream tree with ``git rebase`` (a three-way merge of each patch
    with the blobs of both trees at hand: it resolves what ``git am -3`` on a fresh tree cannot, e.g. two lines
    added at the same place, and stops at a real conflict in ``git rebase``'s state).

    The new tree becomes a root commit tagged ``upstream-base`` (as ``make_base`` makes it, the old base kept as
    ``upstream-base-before-rebase``); the series' commits are replayed onto it. Returns what to do next."""
    if not (tree / ".git").exists():
        raise PatchError(f"{tree} is not a patched working tree (run `ci/patches.py apply` first)")
    dirty = has_unexported_work(tree)
    if dirty:
        raise PatchError(f"{tree} has uncommitted changes; commit or export them first:\n{dirty}")
    if base_ref(tree) == onto:
        raise PatchError(f"{tree} is already on llama.cpp {onto}")
    branch = git(tree, "symbolic-ref", "--short", "-q", "HEAD", check=False).stdout.strip()
    if not branch:
        raise PatchError(f"{tree}: HEAD is detached (finish or abort the `git am` / `git rebase` in progress first)")
    with tempfile.TemporaryDirectory(dir=upstream.cache_root()) as tmp:
        new_tree = Path(tmp) / "tree"
        upstream.extract_tree(onto, new_tree)
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(tree, f"--work-tree={new_tree}", "add", "-A", "-f", env=env)
        tree_id = git(tree, "write-tree", env=env).stdout.strip()
    new_base = git(tree, "commit-tree", tree_id, "-m", f"upstream llama.cpp {onto}", env=upstream.FIXED_IDENTITY).stdout.strip()
    git(tree, "tag", "-f", OLD_BASE_TAG, BASE_TAG)
    git(tree, "tag", "-f", BASE_TAG, new_base)
    r = git(tree, "rebase", "--onto", BASE_TAG, OLD_BASE_TAG, branch, check=False)
    if r.returncode != 0:
        conflicts = git(tree, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
        stopped = git(tree, "log", "-1", "--format=%s", "REBASE_HEAD", check=False).stdout.strip()
        raise PatchError(f"patch \"{stopped}\" conflicts with llama.cpp {onto} in: {', '.join(conflicts) or '?'}\n"
                         f"resolve it in {tree}, `git add` the files and `git rebase --continue` (the rest of the series "
                         f"follows); then build, fix what no longer compiles with `git commit --fixup`, and "
                         f"`python3 ci/patches.py export` (docs/upstreaming.md)")
    return f"rebased onto llama.cpp {onto}: build, fix with `git commit --fixup`, then `python3 ci/patches.py export`"


def check(patch_dir: Path = PATCH_DIR) -> None:
    """apply → export into a temp dir (given ``series`` for its PRs) must reproduce ``patch_dir`` byte for byte."""
    with tempfile.TemporaryDirectory(dir=upstream.cache_root()) as tmp:
        tree = apply(Path(tmp) / "llama.cpp", patch_dir)
        again = Path(tmp) / "exported"
        again.mkdir()
        if (patch_dir / SERIES_FILE).is_file():
            shutil.copy(patch_dir / SERIES_FILE, again / SERIES_FILE)
        export(tree, again)
        a = [name(p, patch_dir) for p in series(patch_dir)]
        b = [name(p, again) for p in series(again)]
        if a != b:
            raise PatchError(f"round trip changed the series' file names or order:\n  {a}\n  {b}")
        if a and not filecmp.cmp(patch_dir / SERIES_FILE, again / SERIES_FILE, shallow=False):
            raise PatchError(f"round trip changed {SERIES_FILE}: run `ci/patches.py export` and commit the result")
        for n in a:
            if not filecmp.cmp(patch_dir / n, again / n, shallow=False):
                raise PatchError(f"round trip changed {n}: run `ci/patches.py export` and commit the result")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patches", type=Path, default=PATCH_DIR, help="patch series folder (default: ggml-patches/)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply", help="fresh copy of the pinned tree with the series applied as commits")
    a.add_argument("--tree", type=Path, default=DEFAULT_WORKTREE, help="where (default: work/llama.cpp)")
    a.add_argument("--force", action="store_true", help="discard uncommitted changes in an existing tree")
    a.add_argument("--upstream", default=upstream.PIN, metavar="TREE",
                   help=f"upstream tree to apply to: a name of `ci/upstream.py list` (default: the pin, {upstream.PIN}; "
                        "fetched when missing) or a commit cached by ci/check_upstream.py")
    e = sub.add_parser("export", help="regenerate the series from upstream-base..HEAD of a patched tree")
    e.add_argument("--tree", type=Path, default=DEFAULT_WORKTREE)
    y = sub.add_parser("sync", help="apply if the tree is missing or stale and holds no local work (used by setup)")
    y.add_argument("--tree", type=Path, default=DEFAULT_WORKTREE)
    r = sub.add_parser("rebase", help="move a patched tree onto another upstream tree (git rebase, three-way)")
    r.add_argument("--tree", type=Path, default=DEFAULT_WORKTREE)
    r.add_argument("--onto", default=upstream.PIN, metavar="TREE",
                   help=f"a name of `ci/upstream.py list` (default: the pin, {upstream.PIN}) or a cached commit")
    sub.add_parser("check", help="verify apply → export reproduces the series byte for byte")
    sub.add_parser("list", help="list the series in order, by PR")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "apply":
            if args.upstream in upstream.TREES:
                upstream.fetch(args.upstream)
            tree = apply(args.tree, args.patches, args.force, args.upstream)
            print(f"patches: applied {len(series(args.patches))} patch(es) onto {args.upstream[:12]} in {tree}")
        elif args.cmd == "export":
            out = export(args.tree, args.patches)
            print(f"patches: exported {len(out)} patch(es) to {args.patches}")
        elif args.cmd == "rebase":
            if args.onto in upstream.TREES:
                upstream.fetch(args.onto)
            print(f"patches: {rebase(args.tree, args.onto)}")
        elif args.cmd == "sync":
            upstream.fetch()
            print(f"patches: {args.tree}: {sync(args.tree, args.patches)}")
        elif args.cmd == "check":
            upstream.fetch()
            check(args.patches)
            print(f"patches: round trip of {len(series(args.patches))} patch(es) is byte-identical")
        else:
            for group, files in groups(args.patches):
                print(f"{group.name}: {group.title}")
                for p in files:
                    print(f"    {name(p, args.patches)}")
    except (PatchError, upstream.UpstreamError) as e:
        return upstream.cli_failed("patches", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
