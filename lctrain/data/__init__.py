"""The data stage: sources -> tokenization -> mixture -> packing -> the packed store (docs/design.md §2).

Entry points: `lctrain.data.prepare.prepare(cfg)` and `lctrain.data.store.open_packed(path)`.
"""
