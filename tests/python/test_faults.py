"""Faults of the converter and the trainer (issue 14, part 4): real processes killed with SIGKILL at chosen and at
seeded random points, and full disks.

Converter (``convert/to_gguf.py`` on the tiny QAT teacher, S3D8: the tensor writes span seconds, the S3D8 encoder
runs between them): killed when its temporary file appears, stopped (SIGSTOP) and then killed mid-way through the
tensor data, and killed after seeded random delays. After every kill the output name holds either nothing, the
previous file byte for byte, or - for a kill after the rename - the complete output byte for byte. A SIGKILLed
process cannot clean up, so its temporary file can remain: ``.<OUTFILE name>.<random>.partial``, hidden, never
ending in ``.gguf``; the tests check that nothing else is ever left.

Trainer (``python -m qat.train`` on the same teacher, checkpoint every step): killed in the middle of torch.save of
a checkpoint (deterministically: the temporary checkpoint path, ``.checkpoint.pt.<pid>.tmp``, is made a FIFO before
the process starts, the test reads the first MiB of the checkpoint from it and kills the writer while it is blocked
inside torch.save; no hook in qat.train), then killed after a seeded random delay while a watcher checks that
``checkpoint.pt`` always ends with a zip end record (never a partial file). Every kill leaves a checkpoint that
loads, with the uninterrupted run's losses as a prefix, and resuming ends bit for bit where the uninterrupted run
ends; the killed runs' temporary files are removed by the resuming run.

Full disk: the file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG, "File too
large"), which needs no privileges, and a real small tmpfs (ENOSPC, "No space left on device"), which needs root to
mount. Both tools exit with status 2 and one line naming the output and the OS's reason, no traceback, the previous
output byte-identical and no temporary file left.

Cost: about 11 process starts of ~3-8 s each (about a minute on an idle 2-core machine).
"""

from __future__ import annotations

import os
import random
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from qat.checkpoint import load_checkpoint
from qat.train import main as train_main
from test_qat_train import _DIST_ENV, _args, _assert_identical, setup, straight  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
#: Upper bound of any single wait (process start, conversion, training run), for a heavily loaded machine.
WAIT_S = 600
POLL_S = 0.005
SEED = 14

CONVERT = [str(REPO / "convert" / "to_gguf.py"), "--type", "s3d8", "--no-progress", "--tokenizer-pre", "llama-bpe"]
OUT = "out.gguf"
PARTIAL = re.compile(r"^\.out\.gguf\.[A-Za-z0-9_]+\.partial$")
CK = "checkpoint.pt"
CK_TMP = re.compile(r"^\.checkpoint\.pt\.\d+\.tmp$")


# ---------------------------------------------------------------------------------------------------
# processes


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def _start(argv: list[str], log: Path, preexec: Callable[[], None] | None = None) -> subprocess.Popen:
    """``python argv`` in its own session (so a SIGKILL reaches nothing else), stdout and stderr into ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen([PY, *argv], cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=preexec)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _kill(p: subprocess.Popen) -> int:
    _signal(p, signal.SIGKILL)
    return p.wait(timeout=WAIT_S)


def _wait_until(p: subprocess.Popen, cond: Callable[[], bool], what: str, log: Path,
                also: Callable[[], None] | None = None) -> None:
    """Poll ``cond`` every POLL_S until it holds; fail if the process ends first (or after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if also is not None:
            also()
        if p.poll() is not None:
            pytest.fail(f"the process ended (status {p.returncode}) before {what}:\n{_tail(log)}", pytrace=False)
        if time.monotonic() > deadline:
            _kill(p)
            pytest.fail(f"timeout waiting for {what}:\n{_tail(log)}", pytrace=False)
        time.sleep(POLL_S)


def _sleep_or_exit(p: subprocess.Popen, seconds: float, also: Callable[[], None] | None = None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and p.poll() is None:
        if also is not None:
            also()
        time.sleep(POLL_S)


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _file_size_limit(limit: int) -> Callable[[], None]:
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _error_line(log: Path) -> str:
    """The one ``error:`` line of a failed run (warnings of libraries may precede it; no traceback)."""
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text
    return errors[0]


def _others(directory: Path, keep: set[str], temp: re.Pattern) -> list[str]:
    """Files in ``directory`` other than ``keep``; each must be a recognisable temporary file of a killed run."""
    left = sorted(p.name for p in directory.iterdir() if p.name not in keep)
    for name in left:
        assert temp.match(name) and not name.endswith((".gguf", ".pt")), f"unexpected file {name!r} in {directory}"
    return left


@pytest.fixture
def small_disk(tmp_path: Path):
    """``small_disk(nbytes)``: a tmpfs of that size mounted under tmp_path (root only), unmounted afterwards."""
    mounted: list[Path] = []

    def mount(nbytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE variant of this test runs without)")
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=0755", "s3d8-full-disk-test", str(d)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs although root (no CAP_SYS_ADMIN?): {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        if subprocess.run(["umount", str(d)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=60)


# ---------------------------------------------------------------------------------------------------
# converter


@pytest.fixture(scope="module")
def conversion(setup, tmp_path_factory) -> tuple[Path, float]:
    """The uninterrupted conversion's output and wall time (the converter is deterministic: same seed, same file)."""
    d = tmp_path_factory.mktemp("convert-ref")
    t0 = time.monotonic()
    p = _start([*CONVERT, str(setup[0]), "-o", str(d / OUT)], d / "log")
    assert p.wait(timeout=WAIT_S) == 0, _tail(d / "log")
    seconds = time.monotonic() - t0
    assert sorted(x.name for x in d.iterdir()) == ["log", OUT]
    return d / OUT, seconds


def test_convert_output_mode(conversion) -> None:
    """The output has the permissions a plain open() gives (0666 less the umask), not its temp file's 0600."""
    mode = stat.S_IMODE(conversion[0].stat().st_mode)
    umask = os.umask(0o22)
    os.umask(umask)
    assert mode == 0o666 & ~umask, f"output mode {mode:o}, umask {umask:o}"


def _partials(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if PARTIAL.match(p.name)]


def _run_dir(tmp_path: Path, name: str, previous: bytes | None) -> tuple[Path, Path]:
    d = tmp_path / name
    d.mkdir()
    if previous is not None:
        (d / OUT).write_bytes(previous)
    return d, tmp_path / f"{name}.log"


def test_convert_sigkill_when_temp_file_appears(setup, tmp_path) -> None:
    """Killed as soon as its temporary file exists (header being written): no output, at most that temp file."""
    d, log = _run_dir(tmp_path, "run", None)
    p = _start([*CONVERT, str(setup[0]), "-o", str(d / OUT)], log)
    _wait_until(p, lambda: bool(_partials(d)), "the temporary file appeared", log)
    assert _kill(p) == -signal.SIGKILL
    assert not (d / OUT).exists()
    assert len(_others(d, set(), PARTIAL)) == 1


def test_convert_sigkill_mid_tensor_data(setup, conversion, tmp_path) -> None:
    """Stopped while its temporary file holds part of the tensor data, then killed: the previous output is
    untouched throughout, the temp file is a strict prefix-sized partial file, not the output."""
    ref = conversion[0].read_bytes()
    previous = b"previous output " * 1000
    d, log = _run_dir(tmp_path, "run", previous)
    p = _start([*CONVERT, str(setup[0]), "-o", str(d / OUT)], log)

    def mid_way() -> bool:
        parts = _partials(d)
        try:
            return bool(parts) and parts[0].stat().st_size >= 64 << 10  # header, KV and tensor infos are ~18 KiB
        except FileNotFoundError:
            return False

    _wait_until(p, mid_way, "tensor data was being written", log)
    _signal(p, signal.SIGSTOP)
    try:
        parts = _partials(d)
        assert len(parts) == 1, "the conversion finished before it could be stopped"
        assert 64 << 10 <= parts[0].stat().st_size < len(ref)
        assert (d / OUT).read_bytes() == previous
    finally:
        rc = _kill(p)
    assert rc == -signal.SIGKILL
    assert (d / OUT).read_bytes() == previous
    assert _others(d, {OUT}, PARTIAL) == [parts[0].name]


def test_convert_sigkill_at_random_points(setup, conversion, tmp_path) -> None:
    """Two conversions into one folder that holds a previous output, each SIGKILLed after a seeded random share
    of the uninterrupted run's wall time (or finishing first): the output name holds exactly the previous file or
    exactly the complete new one after every kill, never anything else."""
    ref, seconds = conversion[0].read_bytes(), conversion[1]
    previous = b"previous output " * 1000
    d, log = _run_dir(tmp_path, "run", previous)
    rng = random.Random(SEED)
    outcomes = []
    for i in range(2):
        p = _start([*CONVERT, str(setup[0]), "-o", str(d / OUT)], log)
        _sleep_or_exit(p, rng.uniform(0.4, 1.1) * seconds)
        rc = _kill(p)
        now = (d / OUT).read_bytes()
        assert now in (previous, ref), f"kill {i}: {len(now)} bytes under the output name"
        assert rc in (0, -signal.SIGKILL) and (rc != 0 or now == ref), (rc, _tail(log))
        outcomes.append("finished" if rc == 0 else "killed, output " + ("new" if now == ref else "previous"))
        if now == ref:
            (d / OUT).write_bytes(previous)
    left = _others(d, {OUT}, PARTIAL)
    assert len(left) <= sum(o.startswith("killed") for o in outcomes), (outcomes, left)
    print("outcomes:", outcomes, "temp files left:", len(left))


def test_convert_file_size_limit(setup, tmp_path) -> None:
    """RLIMIT_FSIZE 1 MiB (no privileges needed; the 3.3 MiB Q8_0 output cannot be written): exit 2, one line
    naming the output and "File too large", the previous output byte-identical, no temporary file left."""
    previous = os.urandom(100_000)
    d, log = _run_dir(tmp_path, "run", previous)
    argv = [*CONVERT, str(setup[0]), "-o", str(d / OUT), "--type", "q8_0"]
    p = _start(argv, log, preexec=_file_size_limit(1 << 20))
    assert p.wait(timeout=WAIT_S) == 2, _tail(log)
    line = _error_line(log)
    assert str(d / OUT) in line and "File too large" in line, line
    assert (d / OUT).read_bytes() == previous
    assert _others(d, {OUT}, PARTIAL) == []


def test_convert_full_disk(setup, tmp_path, small_disk) -> None:
    """A 2 MiB tmpfs holding a 512 KiB previous output: ENOSPC mid-way, exit 2, one line naming the output and
    "No space left on device", the previous output byte-identical, no temporary file left."""
    d = small_disk(2 << 20)
    previous = os.urandom(512 << 10)
    (d / OUT).write_bytes(previous)
    log = tmp_path / "run.log"
    p = _start([*CONVERT, str(setup[0]), "-o", str(d / OUT), "--type", "q8_0"], log)
    assert p.wait(timeout=WAIT_S) == 2, _tail(log)
    line = _error_line(log)
    assert str(d / OUT) in line and "No space left on device" in line, line
    assert (d / OUT).read_bytes() == previous
    assert _others(d, {OUT}, PARTIAL) == []


# ---------------------------------------------------------------------------------------------------
# trainer


def _complete_zip(path: Path) -> bool:
    """Whether ``path`` ends with a zip end-of-central-directory record (torch.save's last bytes)."""
    with open(path, "rb") as f:
        f.seek(-22, os.SEEK_END)
        return f.read(4) == b"PK\x05\x06"


class _CheckpointWatcher:
    """Called while a run goes on: whenever ``checkpoint.pt`` exists, it is a complete file."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, 0

    def __call__(self) -> None:
        try:
            ok = _complete_zip(self.path)
        except FileNotFoundError:
            return
        assert ok, f"{self.path} is a partial file"
        self.seen += 1


def _assert_prefix_of(path: Path, ref: Path) -> int:
    """The checkpoint loads and its losses are the first ``step`` losses of ``ref`` bit for bit; returns step."""
    ck, want = load_checkpoint(path), load_checkpoint(ref)
    assert ck["losses"] == want["losses"][: ck["step"]] and len(ck["losses"]) == ck["step"]
    return int(ck["step"])


def _read_from_fifo(p: subprocess.Popen, fd: int, nbytes: int, log: Path) -> bytes:
    """The first ``nbytes`` a writer writes into the FIFO open (non-blocking) for reading as ``fd``; the caller keeps
    ``fd`` open, so that the writer then blocks in its next write."""
    got = bytearray()
    deadline = time.monotonic() + WAIT_S
    while len(got) < nbytes:
        if p.poll() is not None:
            pytest.fail(f"the trainer ended (status {p.returncode}) before saving:\n{_tail(log)}", pytrace=False)
        if time.monotonic() > deadline:
            _kill(p)
            pytest.fail(f"timeout waiting for the checkpoint save:\n{_tail(log)}", pytrace=False)
        select.select([fd], [], [], 0.1)
        try:
            chunk = os.read(fd, nbytes - len(got))
        except BlockingIOError:  # a writer is there, nothing written yet
            continue
        if not chunk:  # no writer yet (end of file)
            time.sleep(0.05)
        got += chunk
    return bytes(got)


def test_train_sigkill_during_checkpoint_save_and_at_random_then_resume(setup, straight, tmp_path) -> None:
    """1 step (checkpoint at step 1); a resumed run killed inside torch.save of its step-2 checkpoint; a resumed run
    killed after a seeded random delay; a last resume to the end: the uninterrupted run's weights and losses bit for
    bit. checkpoint.pt is complete whenever it exists, and after each kill it loads with the uninterrupted losses as
    its prefix; the killed runs' temporary files are removed by the next run."""
    run = tmp_path / "run"
    every = ("--save-every", "1")
    assert train_main(_args(setup, run, *every, "--stop-after", "1")) == 0
    ck = run / CK
    step1 = ck.read_bytes()
    assert _assert_prefix_of(ck, straight) == 1

    # killed inside torch.save: the temporary checkpoint is a FIFO the test reads from
    log = tmp_path / "kill-in-save.log"
    watch = _CheckpointWatcher(ck)
    t0 = time.monotonic()
    p = _start(["-m", "qat.train", *_args(setup, run, *every)], log)
    fifo = run / f".{CK}.{p.pid}.tmp"
    os.mkfifo(fifo)  # long before the process gets to its first save (imports alone take seconds)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        head = _read_from_fifo(p, fd, 1 << 20, log)
        t_save = time.monotonic() - t0
        assert head.startswith(b"PK\x03\x04")  # torch.save's zip: the process is mid-way through the checkpoint
        watch()
        assert ck.read_bytes() == step1
    finally:
        rc = _kill(p)
        os.close(fd)
    assert rc == -signal.SIGKILL
    assert ck.read_bytes() == step1
    assert _others(run, {CK, "losses.json"}, CK_TMP) == [fifo.name]

    # killed at a seeded random point of a resumed run (steps 2-4 and their saves take about as long as the
    # start-up and step 2 did above)
    delay = random.Random(SEED).uniform(0.5, 1.8) * t_save
    log = tmp_path / "kill-random.log"
    p = _start(["-m", "qat.train", *_args(setup, run, *every)], log)
    _sleep_or_exit(p, delay, also=watch)
    rc = _kill(p)
    assert rc in (0, -signal.SIGKILL), _tail(log)
    step = _assert_prefix_of(ck, straight)
    left = _others(run, {CK, "losses.json"}, CK_TMP)  # the FIFO unless killed before it was removed, a temp file
    assert len(left) <= 2 and (fifo.name in left) == (f"removed {fifo}" not in log.read_text()), left
    print(f"random kill after {delay:.2f} s: status {rc}, checkpoint at step {step}, temp files left {left}, "
          f"checkpoint checked {watch.seen} times")

    assert train_main(_args(setup, run, *every)) == 0
    _assert_identical(ck, straight)
    assert _others(run, {CK, "losses.json"}, CK_TMP) == []


def test_train_file_size_limit(setup, straight, tmp_path) -> None:
    """RLIMIT_FSIZE 1 MiB: the step-1 save fails with EFBIG; exit 2, one line naming the checkpoint and "File too
    large", the previous checkpoint byte-identical, no temporary file left."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(straight, run / CK)
    previous = (run / CK).read_bytes()
    log = tmp_path / "run.log"
    p = _start(["-m", "qat.train", *_args(setup, run, "--no-resume", "--stop-after", "1")], log,
               preexec=_file_size_limit(1 << 20))
    assert p.wait(timeout=WAIT_S) == 2, _tail(log)
    line = _error_line(log)
    assert str(run / CK) in line and "File too large" in line, line
    assert (run / CK).read_bytes() == previous
    assert _others(run, {CK}, CK_TMP) == []


def test_train_full_disk(setup, straight, tmp_path, small_disk) -> None:
    """A tmpfs with room for the previous checkpoint and a quarter more: the new checkpoint does not fit (ENOSPC);
    exit 2, one line naming the checkpoint and "No space left on device", the previous checkpoint byte-identical,
    no temporary file left."""
    size = straight.stat().st_size
    run = small_disk(size + size // 4)
    shutil.copy(straight, run / CK)
    previous = (run / CK).read_bytes()
    log = tmp_path / "run.log"
    p = _start(["-m", "qat.train", *_args(setup, run, "--no-resume", "--stop-after", "1")], log)
    assert p.wait(timeout=WAIT_S) == 2, _tail(log)
    line = _error_line(log)
    assert str(run / CK) in line and "No space left on device" in line, line
    assert (run / CK).read_bytes() == previous
    assert _others(run, {CK}, CK_TMP) == []
