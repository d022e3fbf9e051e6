"""
The architecture sweep (issue 43): every architecture the model libraries ship, through nanogns.convert against the
oracle, each with a verdict held in a golden file.

    cases.py    the cases, enumerated from the libraries (transformers' auto mappings, diffusers' models, timm's
                families, torchvision's classifiers)
    tiny.py     tiny configs derived from a config class by the names of its fields
    hf.py       transformers' models and their examples per task; others.py: diffusers, timm, torchvision
    check.py    one case: convert, a step of two uneven micro-batches, the oracle, the verdict
    golden.py   verdicts.csv (the golden file) and docs/results.md's section made from it
    run.py      the whole sweep as a resumable run (a worker process per batch of cases), the golden file, the docs

tests/test_sweep.py holds the golden verdicts: a fast slice in every run, the whole sweep under `-m sweep`.
"""
