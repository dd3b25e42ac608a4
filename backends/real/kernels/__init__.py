"""Triton kernels of the real backend. Each has a pure-torch reference in `backends.real.reference`
with the same signature; the tests run both under `TRITON_INTERPRET=1` on the CPU."""
