"""Fuzz targets for every parser of untrusted bytes (issue 17, item 8).

    contract.py   the contract every target is held to (error tree, deadline, memory bound)
    targets.py    one function per target: bytes in, contract asserted
    mutate.py     byte-level mutations shared by the strategies (and the nightly script)
    strategies.py structure-aware hypothesis strategies: real frames, mutated
    strategies_ctx.py  ... and the context-coded segments' (the ctx and ans decoders)
    corpus/       past crashers and seeds, replayed by test_fuzz_corpus.py

scripts/fuzz_nightly.py runs the same targets for longer (hypothesis with a large budget, or
atheris, coverage-guided, where it is installed).
"""
