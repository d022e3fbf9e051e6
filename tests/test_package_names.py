"""
One name per thing inside the package (docs/architecture.md's glossary): the per-example squared gradient norm is
`pe_sqnorm` (its buffer `<param>_pe_sqnorm`), the root mean square of a step's per-example norms `rms_pe_norm`, the
batch gradient's norm `norm`, the noise scale `gns`. The reference's spellings (PEGradNormLinear, big_batch_norm,
zero_sqgradnorm_buffers, ...) live in the root faces (buffered.py, fused_gns.py, gnstracking.py, ...) and
nanogns/monitor/reference.py only; the log's column `pegn` is named where the log is written or read.

    python -m pytest -q tests/test_package_names.py
"""

import pathlib
import re

from conftest import REPO

PACKAGE = pathlib.Path(REPO) / "nanogns"
FACES_INSIDE = {"monitor/reference.py"}
RETIRED = {
    r"upegsqnorm": "the buffer suffix is _pe_sqnorm",
    r"sqgradnorm": "zero_pe_sqnorm_buffers",
    r"pesq|PESQ": "pe_sqnorm",
    r"PESqNorm|PEGradNorm": "PerExample<Kind>, Shim<Kind>, Fused<Kind> or PerExampleNormLayer",
    r"(?<!pe_)sqnorms": "pe_sqnorms",
    r"\b(weight|bias)_sq\b": "weight_pe_sqnorms, bias_pe_sqnorms",
    r"small_batch_norm|big_batch_norm": "rms_pe_norm and norm",
}
# the log's column, named as a column (`/pegn`, `pegn`) where rows are written or read
PEGN_OUTSIDE_THE_LOG = re.compile(r"(?<![/`\"'s])pegn(?![`\"'])")
LOG_MODULES = ("runlog/", "analysis/")


def package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in FACES_INSIDE:
            yield rel, path.read_text()


def test_no_retired_spelling_inside_the_package():
    found = []
    for rel, text in package_sources():
        for number, line in enumerate(text.splitlines(), 1):
            for pattern, use in RETIRED.items():
                if re.search(pattern, line):
                    found.append(f"nanogns/{rel}:{number}: {line.strip()}  (use {use})")
            if not rel.startswith(LOG_MODULES) and PEGN_OUTSIDE_THE_LOG.search(line):
                found.append(f"nanogns/{rel}:{number}: {line.strip()}  (use rms_pe_norm; `pegn` is the log's column)")
    assert not found, "\n".join(found)


def test_the_check_finds_what_it_forbids():
    """The patterns are not vacuous: each retired spelling is caught in a line written the old way."""
    old = {
        "weight_upegsqnorm": "upegsqnorm",
        "zero_sqgradnorm_buffers(model)": "sqgradnorm",
        "_ln_bwd_dx_pesq": "pesq|PESQ",
        "class PEGradNormLinear": "PESqNorm|PEGradNorm",
        "summed_sqnorms(ms)": r"(?<!pe_)sqnorms",
        "weight_sq = x": r"\b(weight|bias)_sq\b",
        "m.small_batch_norm": "small_batch_norm|big_batch_norm",
    }
    for line, pattern in old.items():
        assert re.search(pattern, line), line
    assert not re.search(r"(?<!pe_)sqnorms", "segment_weight_pe_sqnorms")
    assert PEGN_OUTSIDE_THE_LOG.search("pegn = sqrt(mean)") and not PEGN_OUTSIDE_THE_LOG.search('row[key + "/pegn"]')
