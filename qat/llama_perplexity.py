"""What ``llama-perplexity`` prints, read once for every script that measures with it.

llama.cpp's maintainers judge a quantised type by the KL divergence and perplexity against the f16 model that
``llama-perplexity --kl-divergence`` prints; the main job (``tools/main_job.py``), the KV-cache benchmark
(``benchmarks/kv_cache.py``), the fit study (``research/s3d8_fit_streams.py``) and the KV-cache tests read
those lines here:

* a base run (``--kl-divergence-base FILE`` without ``--kl-divergence``) prints
  ``Final estimate: PPL = x +/- e``;
* a comparison run prints ``Mean PPL(Q) : x ± e``, ``Mean    KLD: x ± e`` and ``Same top p: x ± e %``;
* a comparison run also prints one line per chunk: the chunk's number, then the running means (over the chunks so
  far, each scoring the same number of tokens) of PPL, ln(PPL(Q)/PPL(base)), KLD, Δp RMS and same top p, each
  ``x ± e``; :func:`chunk_klds` recovers each chunk's own KLD, and :func:`paired_kld_difference` compares two
  models chunk by chunk on the same text (far tighter than comparing the two means with their own errors);
* libllama prints the KV cache it allocated (with ``-lv 4`` or more; llama-perplexity keeps one stream of C cells per
  parallel sequence): ``llama_kv_cache: size = M MiB (C cells, L layers, S/N seqs), ...``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

NAN = float("nan")

_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
_PPL_Q = re.compile(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)")
_KLD = re.compile(r"Mean\s+KLD:\s*([\d.]+)\s*±\s*([\d.]+)")
_SAME_TOP = re.compile(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)\s*%")
_CHUNK = re.compile(r"^\s*(\d+)\s+([\d.]+)\s*±\s*[\d.]+\s+(-?[\d.]+)\s*±\s*[\d.]+\s+([\d.]+)\s*±", re.M)
_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*\d+ layers,\s*\d+/(\d+) seqs\)")


@dataclass(frozen=True)
class PerplexityResult:
    """One run's figures; NaN where the run does not print them (a base run has no KLD)."""

    ppl: float = NAN
    ppl_err: float = NAN
    kld: float = NAN
    kld_err: float = NAN
    same_top: float = NAN  #: share of positions whose top token is the base's, in percent
    same_top_err: float = NAN
    kv_cache_mib: float = NAN  #: size of the self-attention KV cache libllama allocated
    kv_cache_cells: int = 0  #: its cells over all streams

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_cache_mib * 2**20 / self.kv_cache_cells if self.kv_cache_cells else NAN


class PerplexityOutputError(ValueError):
    """llama-perplexity's output lacks the figures the run should have printed."""


def parse(output: str, *, kld: bool) -> PerplexityResult:
    """The figures of one run's combined stdout + stderr; ``kld`` says whether it was a comparison run (then
    PPL, KLD and same-top are required) or a base run (then the final PPL estimate is)."""
    size = _KV_SIZE.search(output)
    mib, cells = (float(size.group(1)), int(size.group(2)) * int(size.group(3))) if size else (NAN, 0)
    if not kld:
        final = _FINAL.search(output)
        if not final:
            raise PerplexityOutputError("no 'Final estimate: PPL' line in llama-perplexity's output:\n" + output[-3000:])
        return PerplexityResult(ppl=float(final.group(1)), ppl_err=float(final.group(2)), kv_cache_mib=mib,
                                kv_cache_cells=cells)
    ppl, k, top = _PPL_Q.search(output), _KLD.search(output), _SAME_TOP.search(output)
    if not (ppl and k and top):
        raise PerplexityOutputError("no 'Mean PPL(Q)', 'Mean KLD' and 'Same top p' lines in llama-perplexity's "
                                    "output:\n" + output[-3000:])
    return PerplexityResult(ppl=float(ppl.group(1)), ppl_err=float(ppl.group(2)), kld=float(k.group(1)),
                            kld_err=float(k.group(2)), same_top=float(top.group(1)),
                            same_top_err=float(top.group(2)), kv_cache_mib=mib,
                            kv_cache_cells=cells)


def chunk_klds(output: str) -> list[float]:
    """Each chunk's mean KLD in a comparison run, recovered from the running means of the per-chunk lines
    (chunk i's value = i * mean_i - (i - 1) * mean_(i-1): every chunk scores the same number of tokens). The printed
    means have 5 decimals, so chunk i's value is exact to within i * 1e-5."""
    cum: list[float] = []
    for m in _CHUNK.finditer(output):
        if int(m.group(1)) != len(cum) + 1:
            raise PerplexityOutputError(f"chunk line {m.group(1)} out of order in llama-perplexity's output")
        cum.append(float(m.group(4)))
    if not cum:
        raise PerplexityOutputError("no per-chunk lines in llama-perplexity's output:\n" + output[-3000:])
    return [i * c - (i - 1) * p for i, (c, p) in enumerate(zip(cum, [0.0] + cum[:-1]), start=1)]


@dataclass(frozen=True)
class PairedDifference:
    """KLD of model B minus model A over the same chunks: mean, its standard error (chunks as the units), and the
    number of chunks where B is lower."""

    mean: float
    stderr: float
    n_lower: int
    n: int

    def __str__(self) -> str:
        return (f"{self.mean:+.4f} ± {self.stderr:.4f} (t = {self.mean / self.stderr:+.1f}; B lower on "
                f"{self.n_lower} of {self.n} chunks)")


def paired_kld_difference(a: list[float], b: list[float]) -> PairedDifference:
    """B - A per chunk (:func:`chunk_klds` of two runs on the same text and base)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two runs over the same chunks (at least 2), got {len(a)} and {len(b)}")
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((v - mean) ** 2 for v in d) / (len(d) - 1)
    return PairedDifference(mean, math.sqrt(var / len(d)), sum(v < 0 for v in d), len(d))
