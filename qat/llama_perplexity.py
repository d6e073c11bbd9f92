"""What ``llama-perplexity`` prints, read once for every script that measures with it.

llama.cpp's maintainers judge a quantised type by the KL divergence and perplexity against the f16 model that
``llama-perplexity --kl-divergence`` prints; the main job (``tools/main_job.py``), the KV-cache benchmark
(``benchmarks/kv_cache.py``), the fit study (``benchmarks/s3d8_fit_streams.py``) and the KV-cache tests read
those lines here:

* a base run (``--kl-divergence-base FILE`` without ``--kl-divergence``) prints
  ``Final estimate: PPL = x +/- e``;
* a comparison run prints ``Mean PPL(Q) : x ± e``, ``Mean    KLD: x ± e`` and ``Same top p: x ± e %``;
* libllama prints the KV cache it allocated (with ``-lv 4`` or more; llama-perplexity keeps one stream of C cells per
  parallel sequence): ``llama_kv_cache: size = M MiB (C cells, L layers, S/N seqs), ...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAN = float("nan")

_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
_PPL_Q = re.compile(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)")
_KLD = re.compile(r"Mean\s+KLD:\s*([\d.]+)\s*±\s*([\d.]+)")
_SAME_TOP = re.compile(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)\s*%")
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
