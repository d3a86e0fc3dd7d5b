"""exactspec on CUDA: batch-invariant Triton kernels (kernels.py) behind `exactspec.hf.patch` for a
transformers model on a GPU. Needs triton (`pip install 'exactspec[cuda]'`; CUDA builds of torch bring
it); the tests run every kernel on the CPU under TRITON_INTERPRET=1."""
