"""
The machinery of variant families that build on every kind (their layer classes are declared by the kinds):

    fused/    Triton glue: launch plans, custom ops and autograd Functions around nanogns/kernels/; falls back to
              the gns computation (same numbers) where Triton or a supported GPU is missing
    sogns.py  SOGNS's approximate per-example norms of a Linear weight (Gray et al. 2024), for comparison
"""
